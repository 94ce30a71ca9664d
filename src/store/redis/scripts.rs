//! The Lua scripts of a [`RedisStore`](super::RedisStore), one per transition, and how their
//! arguments and replies are written and read.

use std::{cell::RefCell, io::Write, sync::LazyLock, time::Duration};

use bytes::Bytes;
use deadpool_redis::redis::{
    Cmd, ErrorKind, FromRedisValue, RedisResult, RedisWrite, Script, ServerErrorKind, Value,
    aio::ConnectionLike,
};

use crate::{
    key::RecordKey,
    store::{Claim, StoreError},
};

macro_rules! script {
    ($name:literal) => {
        LazyLock::new(|| {
            Script::new(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/", $name)))
        })
    };
}

pub(super) static ABANDON: LazyLock<Script> = script!("abandon.lua");
pub(super) static ANNOUNCE: LazyLock<Script> = script!("announce.lua");
pub(super) static BLOOM: LazyLock<Script> = script!("bloom.lua");
pub(super) static CLAIM: LazyLock<Script> = script!("claim.lua");
pub(super) static COMPLETE: LazyLock<Script> = script!("complete.lua");
pub(super) static DEDUP: LazyLock<Script> = script!("dedup.lua");
pub(super) static FORGET: LazyLock<Script> = script!("forget.lua");
pub(super) static INSPECT: LazyLock<Script> = script!("inspect.lua");
pub(super) static RELEASE: LazyLock<Script> = script!("release.lua");
pub(super) static TOUCH: LazyLock<Script> = script!("touch.lua");

/// One `EVALSHA` of a script, its command built in one buffer (redis-rs's `ScriptInvocation`
/// first copies every key and argument into a vector of its own: two allocations each, a
/// sixth of a fresh request's). The command's buffers are a spare's of this thread when
/// there is one, and kept as a spare when the call ends ([`SPARE`]).
pub(super) struct ScriptCall {
    script: &'static Script,
    command: Cmd,
    /// The bytes the command was sized for: a command larger than [`SPARE_BYTES`] is not kept.
    bytes: usize,
}

thread_local! {
    /// The commands of script calls that ended on this thread, for the next calls to write
    /// into: a command otherwise costs two allocations (its arguments' places and its
    /// bytes), and a fresh request two commands.
    static SPARE: RefCell<Vec<Cmd>> = const { RefCell::new(Vec::new()) };
}

/// How many spare commands a thread keeps: as many as its calls that run at once, up to this.
const SPARES: usize = 16;

/// The largest command kept as a spare: a record with a large response is let go with its
/// call, so no spare holds more than this (and what a few more arguments grow it by).
const SPARE_BYTES: usize = 4096;

impl Drop for ScriptCall {
    fn drop(&mut self) {
        if self.bytes <= SPARE_BYTES {
            let mut command = std::mem::take(&mut self.command);
            command.clear();
            // A thread that is ending keeps nothing.
            let _ = SPARE.try_with(|spare| {
                let mut spare = spare.borrow_mut();
                if spare.len() < SPARES {
                    spare.push(command);
                }
            });
        }
    }
}

impl ScriptCall {
    /// `script` over `keys` and `args`; `more` bytes are kept free for a
    /// [`joined`](Self::joined) argument.
    pub(super) fn new(script: &'static Script, keys: &[&str], args: &[&[u8]], more: usize) -> Self {
        let bytes = keys.iter().map(|key| key.len()).sum::<usize>();
        let mut call = Self::start(script, keys.len(), args, bytes + more);
        for key in keys {
            call.command.arg(*key);
        }
        call.args(args)
    }

    /// `script` over a record's key and its [`settle_channel`], then `args`; `more` bytes are
    /// kept free for a [`joined`](Self::joined) argument. The channel is written in the
    /// command's own buffer, not built apart.
    pub(super) fn publishing(
        script: &'static Script,
        key: &RecordKey,
        args: &[&[u8]],
        more: usize,
    ) -> Self {
        let key = key.as_str().as_bytes();
        Self::start(script, 2, args, 2 * key.len() + SETTLED.len() + more)
            .joined(&[key])
            .joined(&[key, SETTLED.as_bytes()])
            .args(args)
    }

    /// An `EVALSHA` of `script` with `keys` keys, its buffers sized for them (`key_bytes`,
    /// with what a joined argument needs) and `args`.
    fn start(script: &'static Script, keys: usize, args: &[&[u8]], key_bytes: usize) -> Self {
        let arg_bytes = args.iter().map(|arg| arg.len()).sum::<usize>();
        let (places, bytes) = (4 + keys + args.len(), 7 + 40 + 4 + key_bytes + arg_bytes);
        let spare = match bytes <= SPARE_BYTES {
            true => SPARE.try_with(|spare| spare.borrow_mut().pop()).ok().flatten(),
            false => None,
        };
        let mut command = match spare {
            // Cleared when it was kept.
            Some(command) => command,
            None => Cmd::with_capacity(places, bytes),
        };
        command.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        Self { script, command, bytes }
    }

    fn args(mut self, args: &[&[u8]]) -> Self {
        for arg in args {
            self.command.arg(*arg);
        }
        self
    }

    /// Appends one argument made of `pieces`, joined in the command's own buffer: a record
    /// written whole without a copy of its own on either side.
    pub(super) fn joined(mut self, pieces: &[&[u8]]) -> Self {
        let mut arg = self.command.writer_for_next_arg();
        for piece in pieces {
            // Writing into the command's `Vec` cannot fail.
            let _ = arg.write_all(piece);
        }
        drop(arg);
        self
    }

    /// Sends the call. On `NOSCRIPT` (a server restarted or promoted, a `SCRIPT FLUSH`) the
    /// script is loaded and the same command sent again.
    pub(super) async fn query<T: FromRedisValue>(
        &self,
        connection: &mut (impl ConnectionLike + Send),
    ) -> RedisResult<T> {
        match self.command.query_async(connection).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.script.load_async(connection).await?;
                self.command.query_async(connection).await
            }
            reply => reply,
        }
    }
}

/// Where the response starts in a completed record: after the version, the state and the
/// fingerprint.
const RESPONSE_OFFSET: usize = 1 + 1 + 32;

/// The channel a record's settle is published on; it carries the record's hash tag, so it
/// lives in the record's cluster slot.
pub(super) fn settle_channel(key: &RecordKey) -> String {
    [key.as_str(), SETTLED].concat()
}

/// What a record's key is followed by in its settle channel's name.
const SETTLED: &str = ":settled";

pub(super) fn millis(duration: Duration) -> u64 {
    // PEXPIRE needs at least 1 ms; a zero lease would be an error, not an instant expiry.
    whole_millis(duration).max(1)
}

/// `duration` in whole milliseconds, zero included. Bounded so that the scripts' arithmetic
/// (Lua numbers are doubles) stays exact: 2^50 ms is over 35,000 years.
pub(super) fn whole_millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX).min(1 << 50)
}

/// Reads the reply of `lua/claim.lua`.
pub(super) fn parse_claim(reply: Value) -> Result<Claim, StoreError> {
    let unexpected =
        || StoreError::CorruptRecord("unexpected reply from the claim script".to_owned());
    let items = match reply {
        Value::Int(0) => return Ok(Claim::Claimed),
        Value::Int(5) => return Ok(Claim::TakenOver),
        Value::Array(items) => items,
        _ => return Err(unexpected()),
    };
    let mut items = items.into_iter();
    let Some(Value::Int(code)) = items.next() else { return Err(unexpected()) };
    match (code, items.next()) {
        (1, Some(Value::BulkString(record))) if record.len() >= RESPONSE_OFFSET => {
            // A record without an expiry (PTTL -1, not written by this layer) has no time left
            // to be copied for.
            let remaining = match items.next() {
                Some(Value::Int(ms)) => Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
                _ => Duration::ZERO,
            };
            let response = Bytes::from(record).slice(RESPONSE_OFFSET..);
            Ok(Claim::Replay { response, remaining })
        }
        (2, None) => Ok(Claim::Mismatch),
        (6, None) => Err(StoreError::ClaimAbandoned),
        (3, Some(Value::Int(remaining_ms))) => Ok(Claim::InProgress {
            remaining: Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(0)),
        }),
        (4, Some(Value::BulkString(reason))) => {
            Err(StoreError::CorruptRecord(String::from_utf8_lossy(&reason).into_owned()))
        }
        _ => Err(unexpected()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claims_reply_is_read_whatever_its_shape() {
        let record = |response: &[u8]| [b"1C".as_slice(), &[7; 32], response].concat();
        let replay = |ttl: i64, record: Vec<u8>| {
            parse_claim(Value::Array(vec![
                Value::Int(1),
                Value::BulkString(record),
                Value::Int(ttl),
            ]))
        };
        let Ok(Claim::Replay { response, remaining }) = replay(86_399_123, record(b"4:2 ok"))
        else {
            panic!("not a replay")
        };
        assert_eq!((&response[..], remaining), (&b"4:2 ok"[..], Duration::from_millis(86_399_123)));
        let Ok(Claim::Replay { response, remaining }) = replay(-1, record(b"")) else { panic!() };
        assert_eq!((&response[..], remaining), (&b""[..], Duration::ZERO));
        let truncated = replay(5, b"1C".to_vec());
        assert!(matches!(truncated, Err(StoreError::CorruptRecord(_))), "{truncated:?}");
        assert!(matches!(parse_claim(Value::Int(0)), Ok(Claim::Claimed)));
        assert!(matches!(parse_claim(Value::Int(5)), Ok(Claim::TakenOver)));
        assert!(matches!(parse_claim(Value::Int(1)), Err(StoreError::CorruptRecord(_))));
        let bulk = parse_claim(Value::BulkString(record(b"r")));
        assert!(matches!(bulk, Err(StoreError::CorruptRecord(_))), "{bulk:?}");
        let in_progress = parse_claim(Value::Array(vec![Value::Int(3), Value::Int(250)]));
        assert!(
            matches!(in_progress, Ok(Claim::InProgress { remaining }) if remaining.as_millis() == 250)
        );
    }

    #[test]
    fn a_call_on_a_spare_command_is_written_as_on_a_new_one() {
        let key = RecordKey::new("p", b"", b"k");
        let long: [&[u8]; 3] = [&[7; 300], b"owner", b"60000"];
        let short: [&[u8]; 2] = [b"o", b""];
        let packed = |args: &[&[u8]]| {
            let call = ScriptCall::publishing(&COMPLETE, &key, args, 2).joined(&[b"a", b"b"]);
            call.command.get_packed_command()
        };
        // Written into new buffers: the spares of this thread taken first.
        let taken: Vec<_> = std::iter::from_fn(|| SPARE.with_borrow_mut(Vec::pop)).collect();
        let (new_long, new_short) = (packed(&long), packed(&short));
        drop(taken);
        for _ in 0..3 {
            // The long call's command, kept as a spare, is the short one's, and back.
            drop(ScriptCall::publishing(&COMPLETE, &key, &long, 0));
            let short_call = ScriptCall::publishing(&COMPLETE, &key, &short, 2);
            assert_eq!(short_call.joined(&[b"a", b"b"]).command.get_packed_command(), new_short);
            let long_call = ScriptCall::publishing(&COMPLETE, &key, &long, 2);
            assert_eq!(long_call.joined(&[b"a", b"b"]).command.get_packed_command(), new_long);
        }
        assert!(SPARE.with_borrow(Vec::len) <= SPARES);
    }

    #[test]
    fn a_records_settle_channel_shares_its_hash_tag() {
        let key = RecordKey::new("p", b"", b"k");
        assert_eq!(settle_channel(&key), format!("p:{{{}}}:settled", key.hash()));
    }

    #[test]
    fn a_publishing_call_names_the_record_then_its_settle_channel() {
        let key = RecordKey::new("p", b"", b"k");
        let args: [&[u8]; 2] = [b"owner", b""];
        let publishing = ScriptCall::publishing(&COMPLETE, &key, &args, 3).joined(&[b"a", b"bc"]);
        let keys = [key.as_str(), &settle_channel(&key)];
        let spelled_out = ScriptCall::new(&COMPLETE, &keys, &args, 0).joined(&[b"abc"]);
        let packed = publishing.command.get_packed_command();
        assert_eq!(packed, spelled_out.command.get_packed_command());
        let text = String::from_utf8_lossy(&packed);
        assert!(text.contains(&format!("\r\n{}:settled\r\n", key.as_str())), "{text}");
        assert!(text.ends_with("$5\r\nowner\r\n$0\r\n\r\n$3\r\nabc\r\n"), "{text}");
    }
}
