//! [`HeaderFilter`]: which response headers a stored record keeps.

use http::{HeaderMap, HeaderName, HeaderValue, header};

/// Which response headers are stored for replay.
///
/// Defaults to every header except the hop-by-hop headers (and any header that `Connection`
/// names), `Date`, `Set-Cookie` and `Content-Length` (the replay computes its own).
#[derive(Debug, Clone)]
pub(crate) struct HeaderFilter {
    excluded: Vec<HeaderName>,
    /// The lengths of the excluded names, one bit each (bit 63: 63 bytes or more): most
    /// headers are let through on their length alone, without a comparison with each name.
    lengths: u64,
}

/// A header name's bit in [`HeaderFilter::lengths`].
fn length_bit(name: &HeaderName) -> u64 {
    1 << name.as_str().len().min(63)
}

impl Default for HeaderFilter {
    fn default() -> Self {
        Self::excluding(vec![
            header::CONNECTION,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
            header::PROXY_AUTHENTICATE,
            header::PROXY_AUTHORIZATION,
            header::TE,
            header::TRAILER,
            header::TRANSFER_ENCODING,
            header::UPGRADE,
            header::DATE,
            header::SET_COOKIE,
            header::CONTENT_LENGTH,
        ])
    }
}

impl HeaderFilter {
    fn excluding(excluded: Vec<HeaderName>) -> Self {
        let lengths = excluded.iter().fold(0, |lengths, name| lengths | length_bit(name));
        Self { excluded, lengths }
    }

    pub(crate) fn exclude(&mut self, name: HeaderName) {
        if !self.excluded.contains(&name) {
            self.lengths |= length_bit(&name);
            self.excluded.push(name);
        }
    }

    pub(crate) fn include(&mut self, name: &HeaderName) {
        self.excluded.retain(|n| n != name);
        *self = Self::excluding(std::mem::take(&mut self.excluded));
    }

    /// Whether `name` is excluded by name.
    fn excludes(&self, name: &HeaderName) -> bool {
        self.lengths & length_bit(name) != 0 && self.excluded.contains(name)
    }

    /// The headers of `headers` that are stored.
    pub(super) fn kept<'a>(
        &'a self,
        headers: &'a HeaderMap,
    ) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> + 'a {
        // Headers named in `Connection` are hop-by-hop for this response. Looked up once, not
        // once per header: most responses have no `Connection` header.
        let connection = headers.get_all(header::CONNECTION);
        let hop_by_hop = connection.iter().next().is_some();
        let named_by_connection = move |name: &HeaderName| {
            connection.iter().any(|listed| {
                listed.to_str().is_ok_and(|list| {
                    list.split(',').any(|token| token.trim().eq_ignore_ascii_case(name.as_str()))
                })
            })
        };
        headers.iter().filter(move |(name, _)| {
            if self.excludes(name) {
                return false;
            }
            !hop_by_hop || !named_by_connection(name)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_excludes_by_name_at_every_length_and_lets_an_included_name_back() {
        let mut filter = HeaderFilter::default();
        // Two names of one length past 63 bytes (they share the last length bit), and one of
        // exactly 63.
        let long = |c: &str| HeaderName::from_bytes(format!("x-{}", c.repeat(80)).as_bytes());
        let (excluded, kept) = (long("a").unwrap(), long("b").unwrap());
        let sixty_three = HeaderName::from_bytes("c".repeat(63).as_bytes()).unwrap();
        filter.exclude(excluded.clone());
        filter.exclude(sixty_three.clone());
        filter.include(&header::SET_COOKIE);
        let mut headers = HeaderMap::new();
        for name in [&excluded, &kept, &sixty_three, &header::SET_COOKIE, &header::DATE] {
            headers.insert(name.clone(), HeaderValue::from_static("v"));
        }
        let names: Vec<&HeaderName> = filter.kept(&headers).map(|(name, _)| name).collect();
        assert_eq!(names, [&kept, &header::SET_COOKIE]);
        // Included again, a name is kept; an excluded one of the same length still is not.
        filter.include(&excluded);
        let names: Vec<&HeaderName> = filter.kept(&headers).map(|(name, _)| name).collect();
        assert_eq!(names, [&excluded, &kept, &header::SET_COOKIE]);
        filter.include(&sixty_three);
        filter.exclude(header::SET_COOKIE);
        let names: Vec<&HeaderName> = filter.kept(&headers).map(|(name, _)| name).collect();
        assert_eq!(names, [&excluded, &kept, &sixty_three]);
    }
}
