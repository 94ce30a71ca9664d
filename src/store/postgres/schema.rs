//! The store's SQL, for its table name: the schema [`migrate`](super::PostgresStore::migrate)
//! runs, and the statements of the transitions.

use std::fmt;

/// The table of [`PostgresStore::new`](super::PostgresStore::new).
pub(super) const DEFAULT_TABLE: &str = "idempotency_records";

/// The statements of one table, its name written in.
#[derive(Debug, Clone)]
pub(super) struct Statements {
    pub(super) table: String,
    pub(super) schema: String,
    pub(super) channel: String,
    pub(super) claim: String,
    pub(super) complete: String,
    pub(super) complete_live: String,
    pub(super) commit: String,
    pub(super) release: String,
    pub(super) touch: String,
    pub(super) abandon: String,
    pub(super) sweep: String,
    pub(super) lapsed: String,
    pub(super) abandoned: String,
    pub(super) inspect: String,
    pub(super) forget: String,
}

impl Statements {
    /// `table` must be a valid name (see [`table_name`]).
    pub(super) fn new(table: &str) -> Self {
        // A function called in the select list, not in FROM: a function scan would store its
        // one row in a tuplestore first, and costs a claim and a replay about 7,500
        // instructions more in the database. The claim's three OUT columns are read from its
        // record in a subquery, which PostgreSQL keeps (the function is volatile), so that the
        // function runs once.
        let call = |function: &str, arguments: usize| {
            let placeholders: Vec<String> = (1..=arguments).map(|i| format!("${i}")).collect();
            format!("SELECT {table}_{function}({})", placeholders.join(", "))
        };
        let channel = format!("{table}_settled");
        // A row past its expiry is absent, whatever it holds; so is an abandoned claim's marker.
        let live = "expires_at > clock_timestamp() AND state IN ('P', 'C')";
        // The owner's live claim, the completion of every fresh request: the complete
        // function's first update, fenced exactly as it is (the owner token, a claim in
        // progress, not expired), sent as a plain statement, which costs the database about
        // 33,000 instructions less than calling the function. Its count of rows says whether
        // it wrote; none, and the function decides the rest (a claim that expired, an
        // abandoned claim's marker, an earlier attempt's answer lost, another owner's key).
        // No RETURNING (a row sent back costs about 14,000 more): a waited record's NOTIFY is
        // sent from the SET, which leaves `waited` as it was. A SET is computed for the row
        // version the update applies to, and again for a newer one (when a concurrent write
        // landed first), so it never misses a waited record; when that newer version is no
        // longer the owner's live claim (a takeover of a lapsed lease, a forced forget, a
        // sweep, each mid-complete), the update writes nothing and the NOTIFY is still sent:
        // a waiter woken so claims again and keeps waiting. Its arguments are the function's,
        // in the function's order.
        let complete_live = format!(
            "UPDATE {table} SET state = 'C', fingerprint = $3, response = $4, \
             lease_until = NULL, expires_at = clock_timestamp() + $5 * INTERVAL '1 millisecond', \
             waited = CASE WHEN waited THEN pg_notify('{channel}', $1) IS NOT NULL ELSE false END \
             WHERE key = $1 AND state = 'P' AND owner = $2 AND expires_at > clock_timestamp()"
        );
        Self {
            table: table.to_owned(),
            schema: super::PostgresStore::SCHEMA.replace(DEFAULT_TABLE, table),
            // `$2`: the response too.
            inspect: format!(
                "SELECT state::text, fingerprint, coalesce(octet_length(response), 0), \
                 CASE WHEN $2 THEN response END, \
                 (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::int8, \
                 (extract(epoch FROM lease_until - clock_timestamp()) * 1000)::int8, waited \
                 FROM {table} WHERE key = $1 AND {live}"
            ),
            // `$2`: force. The row is locked, then deleted when completed, lapsed, or forced;
            // the third column says whether it was waited for.
            forget: format!(
                "WITH found AS (SELECT state, lease_until, waited FROM {table} \
                     WHERE key = $1 AND {live} FOR UPDATE), \
                 gone AS (DELETE FROM {table} t USING found WHERE t.key = $1 \
                     AND (found.state = 'C' OR found.lease_until <= clock_timestamp() OR $2) \
                     RETURNING found.waited) \
                 SELECT (SELECT count(*) FROM found)::int4, (SELECT count(*) FROM gone)::int4, \
                 coalesce((SELECT bool_or(waited) FROM gone), false)"
            ),
            channel,
            claim: format!(
                "SELECT (r).outcome, (r).response, (r).remaining_ms FROM ({} AS r) AS called",
                call("claim", 9)
            ),
            complete: call("complete", 5),
            complete_live,
            commit: call("commit", 6),
            release: call("release", 2),
            touch: call("touch", 4),
            abandon: call("abandon", 5),
            // Rows a claim holds locked are skipped, never waited for.
            sweep: format!(
                "DELETE FROM {table} WHERE key IN (SELECT key FROM {table} \
                 WHERE expires_at <= clock_timestamp() LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            lapsed: format!(
                "SELECT count(*), \
                 (extract(epoch FROM clock_timestamp() - min(lease_until)) * 1000)::int8 \
                 FROM {table} WHERE state = 'P' AND lease_until <= clock_timestamp() \
                 AND expires_at > clock_timestamp()"
            ),
            // The oldest lapses first; `$1` ms lapsed at least, `$2` rows at most.
            abandoned: format!(
                "SELECT key, fingerprint, \
                 (extract(epoch FROM clock_timestamp() - lease_until) * 1000)::int8 \
                 FROM {table} WHERE state = 'P' \
                 AND lease_until <= clock_timestamp() - $1 * interval '1 millisecond' \
                 AND expires_at > clock_timestamp() ORDER BY lease_until LIMIT $2"
            ),
        }
    }
}

/// A table name [`PostgresStore::with_table`](super::PostgresStore::with_table) refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableNameError(String);

impl fmt::Display for TableNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a table name the store takes: lowercase letters, digits and '_', \
             starting with a letter or '_', at most 48 characters",
            self.0
        )
    }
}

impl std::error::Error for TableNameError {}

/// `name`, if it is a lowercase SQL identifier short enough that `{name}_complete` and
/// `{name}_expires_at` are identifiers too (PostgreSQL keeps 63 bytes of a name).
pub(super) fn table_name(name: &str) -> Result<&str, TableNameError> {
    let mut chars = name.chars();
    let starts_well = chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_well = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if starts_well && rest_well && name.len() <= 48 {
        Ok(name)
    } else {
        Err(TableNameError(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_name_is_a_short_lowercase_identifier() {
        for good in ["idempotency_records", "_x", "payments_keys_2"] {
            assert_eq!(table_name(good), Ok(good));
        }
        let long = "a".repeat(49);
        for bad in ["", "2keys", "Keys", "keys; DROP TABLE x", "a-b", "\"q\"", "k.v", long.as_str()]
        {
            assert!(table_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(table_name(&"a".repeat(48)).map(str::len), Ok(48));
        assert!(TableNameError("K".into()).to_string().contains("lowercase letters"));
    }

    #[test]
    fn every_name_in_the_schema_follows_the_table() {
        let statements = Statements::new("pay_keys");
        assert!(!statements.schema.contains(DEFAULT_TABLE));
        for name in [
            "pay_keys_claim(",
            "pay_keys_commit(",
            "pay_keys_settled",
            "pay_keys_expires_at",
            "TABLE IF NOT EXISTS pay_keys (",
        ] {
            assert!(statements.schema.contains(name), "{name}");
        }
        assert_eq!(
            statements.claim,
            "SELECT (r).outcome, (r).response, (r).remaining_ms FROM \
             (SELECT pay_keys_claim($1, $2, $3, $4, $5, $6, $7, $8, $9) AS r) AS called"
        );
        assert_eq!(statements.commit, "SELECT pay_keys_commit($1, $2, $3, $4, $5, $6)");
        assert!(statements.complete_live.starts_with("UPDATE pay_keys SET state = 'C'"));
        assert!(statements.complete_live.contains("pg_notify('pay_keys_settled', $1)"));
        assert_eq!(statements.channel, "pay_keys_settled");
    }
}
