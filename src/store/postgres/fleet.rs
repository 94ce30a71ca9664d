//! The fleet's registry ([`Store::announce`](crate::store::Store::announce)) in the records'
//! table: one row under the registry's key (state `F`, never claimed: no request's key has the
//! registry's prefix), its entries and their times in its `response`, kept until the last of
//! them (the sweeper deletes it after).

use std::{collections::BTreeMap, time::Duration};

use super::{PostgresStore, bounded};
use crate::{key::RecordKey, store::StoreError};

impl PostgresStore {
    /// See [`Store::announce`](crate::store::Store::announce): the row locked, read, merged
    /// and written back in one transaction, by the database's clock.
    pub(super) async fn announce_in(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Vec<String>, StoreError> {
        let table = &self.inner.statements.table;
        let key = registry.as_str();
        if entries.is_empty() {
            // Read only: nothing to write, no row to lock.
            let read = format!(
                "SELECT response, (extract(epoch FROM clock_timestamp()) * 1000)::bigint \
                 FROM {table} WHERE key = $1 AND state = 'F'"
            );
            let query = sqlx::query_as::<_, (Option<Vec<u8>>, i64)>(&read).bind(key);
            let row = bounded(self.command_timeout, query.fetch_optional(&self.inner.pool)).await?;
            return Ok(row.map_or_else(Vec::new, |(stored, now)| {
                read_entries(stored.as_deref().unwrap_or_default(), now).into_keys().collect()
            }));
        }
        // One statement (no transaction to leave open, no lock past it): the entries merged
        // with those kept, each for its longer time, those past it dropped.
        let announce = format!(
            "WITH now AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms), \
             fresh AS (SELECT e.entry, now.ms + e.lasts AS until \
                 FROM unnest($2::text[], $3::bigint[]) AS e(entry, lasts), now) \
             INSERT INTO {table} AS r (key, state, fingerprint, response, expires_at) \
             SELECT $1, 'F', ''::bytea, \
                 convert_to(string_agg(entry || E'\\t' || until, E'\\n') || E'\\n', 'UTF8'), \
                 to_timestamp(max(until) / 1000.0) FROM fresh \
             ON CONFLICT (key) DO UPDATE SET response = ( \
                 SELECT convert_to(coalesce(string_agg(entry || E'\\t' || until, E'\\n'), '') \
                     || E'\\n', 'UTF8') \
                 FROM (SELECT entry, max(until) AS until FROM ( \
                     SELECT split_part(line, E'\\t', 1) AS entry, \
                         split_part(line, E'\\t', 2)::bigint AS until \
                     FROM regexp_split_to_table(convert_from(coalesce(r.response, ''::bytea), \
                         'UTF8'), E'\\n') AS line \
                     WHERE line ~ E'^[^\\t]+\\t[0-9]+$' \
                     UNION ALL SELECT entry, until FROM fresh) merged, now \
                     WHERE until > now.ms GROUP BY entry) kept), \
                 expires_at = GREATEST(r.expires_at, EXCLUDED.expires_at) \
             WHERE r.state = 'F' \
             RETURNING response"
        );
        let names: Vec<&str> = entries.iter().map(|(entry, _)| entry.as_str()).collect();
        let lasts: Vec<i64> = entries
            .iter()
            .map(|(_, lasts)| i64::try_from(lasts.as_millis()).unwrap_or(i64::MAX).min(1 << 45))
            .collect();
        let query =
            sqlx::query_as::<_, (Option<Vec<u8>>,)>(&announce).bind(key).bind(&names).bind(&lasts);
        let row = bounded(self.command_timeout, query.fetch_optional(&self.inner.pool)).await?;
        let stored = row.and_then(|(stored,)| stored).unwrap_or_default();
        Ok(read_entries(&stored, 0).into_keys().collect())
    }
}

/// The entries of a registry's row that last past `now`: lines of an entry and, after a tab,
/// the time it lasts until (milliseconds since the epoch); any other line is dropped.
fn read_entries(stored: &[u8], now: i64) -> BTreeMap<String, i64> {
    String::from_utf8_lossy(stored)
        .lines()
        .filter_map(|line| {
            let (entry, until) = line.rsplit_once('\t')?;
            let until: i64 = until.parse().ok()?;
            (until > now).then(|| (entry.to_owned(), until))
        })
        .collect()
}
