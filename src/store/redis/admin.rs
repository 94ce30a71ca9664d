//! [`Admin`] for [`RedisStore`]: `lua/inspect.lua` and `lua/forget.lua`, one key each; the
//! listing scans the keyspace (every master of a Cluster) for record keys and inspects each.

use std::time::Duration;

use bytes::Bytes;
use deadpool_redis::redis::{Value, cmd};
use futures_util::future::join_all;

use super::{
    RECORD_VERSION, RedisStore,
    scripts::{FORGET, INSPECT, ScriptCall},
};
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{
        AbandonedClaim, Admin, Forgotten, Inspection, RecordStatus, StoreError, admin::in_progress,
    },
};

/// How many keys a `SCAN` step asks for.
const SCAN_COUNT: usize = 1000;

impl Admin for RedisStore {
    async fn inspect(
        &self,
        key: &RecordKey,
        with_outcome: bool,
    ) -> Result<Option<Inspection>, StoreError> {
        let with: &[u8] = if with_outcome { b"1" } else { b"0" };
        let reply: Value = self
            .invoke(ScriptCall::new(
                &INSPECT,
                &[key.as_str()],
                &[RECORD_VERSION.as_bytes(), with],
                0,
            ))
            .await?;
        parse_inspection(reply, with_outcome)
    }

    async fn forget(&self, key: &RecordKey, force: bool) -> Result<Forgotten, StoreError> {
        let force: &[u8] = if force { b"1" } else { b"0" };
        let args = [RECORD_VERSION.as_bytes(), force, self.publish_command()];
        let reply: Value = self.invoke(ScriptCall::publishing(&FORGET, key, &args, 0)).await?;
        match reply {
            Value::Int(0) => Ok(Forgotten::Absent),
            Value::Int(1) => Ok(Forgotten::Deleted),
            Value::Int(2) => Ok(Forgotten::Running),
            Value::Array(items) => Err(StoreError::CorruptRecord(match items.get(1) {
                Some(Value::BulkString(reason)) => String::from_utf8_lossy(reason).into_owned(),
                _ => "unexpected reply from the forget script".to_owned(),
            })),
            _ => Err(StoreError::CorruptRecord("unexpected reply from the forget script".into())),
        }
    }

    async fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let mut found = Vec::new();
        for node in self.scan_nodes().await? {
            let mut cursor = 0_u64;
            loop {
                let (next, keys) = self.scan_step(&node, cursor).await?;
                let keys: Vec<RecordKey> =
                    keys.into_iter().filter_map(RecordKey::from_stored).collect();
                let inspected = join_all(keys.iter().map(|key| self.inspect(key, false))).await;
                for (key, inspection) in keys.into_iter().zip(inspected) {
                    // A key that went, or is not a record, between the scan and the inspect.
                    let Ok(Some(Inspection { state, fingerprint, .. })) = inspection else {
                        continue;
                    };
                    if let RecordStatus::Lapsed { lapsed_for: lapsed } = state
                        && lapsed >= lapsed_for
                    {
                        found.push(AbandonedClaim::new(key, fingerprint, lapsed));
                    }
                }
                found.sort_by_key(|claim| std::cmp::Reverse(claim.lapsed_for));
                found.truncate(limit);
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(found)
    }
}

/// A node whose keyspace the listing scans: the server (`None`), or a Cluster master.
type Node = Option<(String, u16)>;

impl RedisStore {
    /// The nodes to scan: the one server, or every master of a Cluster.
    async fn scan_nodes(&self) -> Result<Vec<Node>, StoreError> {
        let timeout = self.command_timeout;
        self.connections
            .run(timeout, |connection| async move {
                #[cfg(feature = "cluster")]
                if let Some(cluster) = { connection }.cluster() {
                    let nodes: String = cmd("CLUSTER").arg("NODES").query_async(cluster).await?;
                    return Ok(masters(&nodes).into_iter().map(Some).collect());
                }
                #[cfg(not(feature = "cluster"))]
                drop(connection);
                Ok(vec![None])
            })
            .await
    }

    /// One `SCAN` step on `node` for record keys: the next cursor, and the keys.
    async fn scan_step(&self, node: &Node, cursor: u64) -> Result<(u64, Vec<String>), StoreError> {
        // `{prefix}:{<64 hex>}`: the hash tag holds exactly 64 characters.
        let pattern = format!("*:{{{}}}", "?".repeat(64));
        let mut scan = cmd("SCAN");
        scan.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(SCAN_COUNT);
        let (timeout, scan) = (self.command_timeout, &scan);
        self.connections
            .run(timeout, |mut connection| async move {
                #[cfg(feature = "cluster")]
                if let (Some(cluster), Some((host, port))) = (connection.cluster(), node) {
                    use deadpool_redis::redis::{
                        FromRedisValue as _,
                        cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
                    };
                    let node = SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port };
                    let reply =
                        cluster.route_command(scan.clone(), RoutingInfo::SingleNode(node)).await?;
                    return <(u64, Vec<String>)>::from_redis_value(reply).map_err(Into::into);
                }
                let _ = node;
                scan.query_async(&mut connection).await
            })
            .await
    }
}

/// The masters' addresses in a `CLUSTER NODES` answer, failed ones left out.
#[cfg(feature = "cluster")]
fn masters(nodes: &str) -> Vec<(String, u16)> {
    nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let (_, address, flags) = (fields.next()?, fields.next()?, fields.next()?);
            let master = flags.split(',').any(|flag| flag == "master")
                && !flags.split(',').any(|flag| flag == "fail" || flag == "noaddr");
            let (host, port) = address.split('@').next()?.rsplit_once(':')?;
            master.then(|| Some((host.to_owned(), port.parse().ok()?)))?
        })
        .collect()
}

/// Reads the reply of `lua/inspect.lua`.
fn parse_inspection(reply: Value, with_outcome: bool) -> Result<Option<Inspection>, StoreError> {
    let unexpected =
        || StoreError::CorruptRecord("unexpected reply from the inspect script".into());
    let Value::Array(items) = reply else { return Err(unexpected()) };
    let int = |value: Option<&Value>| match value {
        Some(Value::Int(n)) => Ok(*n),
        _ => Err(unexpected()),
    };
    let millis = |n: i64| Duration::from_millis(u64::try_from(n).unwrap_or(0));
    let fingerprint = || match items.get(1) {
        Some(Value::BulkString(bytes)) => Fingerprint::from_stored(bytes).ok_or_else(unexpected),
        _ => Err(unexpected()),
    };
    match int(items.first())? {
        0 => Ok(None),
        1 => Ok(Some(Inspection {
            state: RecordStatus::Completed,
            time_left: millis(int(items.get(2))?),
            size: usize::try_from(int(items.get(3))?).unwrap_or(0),
            waited_for: false,
            fingerprint: fingerprint()?,
            outcome: match items.get(4) {
                Some(Value::BulkString(outcome)) if with_outcome => {
                    Some(Bytes::copy_from_slice(outcome))
                }
                _ => None,
            },
        })),
        2 => Ok(Some(Inspection {
            state: in_progress(int(items.get(3))?),
            time_left: millis(int(items.get(2))?),
            size: 0,
            waited_for: int(items.get(4))? == 1,
            fingerprint: fingerprint()?,
            outcome: None,
        })),
        4 => Err(StoreError::CorruptRecord(match items.get(1) {
            Some(Value::BulkString(reason)) => String::from_utf8_lossy(reason).into_owned(),
            _ => "not written by this layer".to_owned(),
        })),
        _ => Err(unexpected()),
    }
}

#[cfg(all(test, feature = "cluster"))]
mod tests {
    use super::*;

    #[test]
    fn the_masters_of_a_cluster_nodes_answer() {
        let nodes = "a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460\n\
                     b2 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922\n\
                     c3 127.0.0.1:7002@17002 slave a1 0 0 1 connected\n\
                     d4 127.0.0.1:7003@17003 master,fail - 0 0 3 connected\n";
        let found = masters(nodes);
        assert_eq!(found, [("127.0.0.1".to_owned(), 7000), ("127.0.0.1".to_owned(), 7001)]);
    }
}
