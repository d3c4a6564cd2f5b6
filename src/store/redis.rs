//! The Redis backend (`store.backend = "redis://host:port/db"` or
//! `rediss://`): shared by several visor replicas, so it also holds their
//! rate-limit windows. Keys start with `[store] prefix`. A command whose
//! connection failed (a Redis restart) is retried once on a new connection
//! before the store counts as down. Built with the `redis` feature.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{Backend, DESCRIPTION_TTL, OP_TIMEOUT, StoreError, StoreFuture, Traits};

/// Adds ARGV[1] to KEYS[1] and ARGV[2] to KEYS[2], each expiring ARGV[3]
/// ms after it was created; returns both values.
const COUNT_WINDOW: &str = "local r = redis.call('INCRBY', KEYS[1], ARGV[1]) \
if r == tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end \
local t = redis.call('INCRBY', KEYS[2], ARGV[2]) \
if t == tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end \
return {r, t}";

const UNCOUNT_WINDOW: &str = "if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end \
local t = redis.call('DECRBY', KEYS[1], ARGV[1]) \
if t < 0 then redis.call('INCRBY', KEYS[1], -t) return 0 end \
return t";

pub(super) struct Redis {
    conn: ::redis::aio::ConnectionManager,
    prefix: String,
}

impl Redis {
    /// The client for `url` (nothing is connected yet: the first command
    /// connects). Fails only on a URL or settings the client does not take.
    pub(super) fn new(url: &str, prefix: &str) -> Result<Redis, String> {
        let client = ::redis::Client::open(url)
            .map_err(|e| format!("store.backend: not a usable Redis URL: {e}"))?;
        let config = ::redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(OP_TIMEOUT))
            .set_response_timeout(Some(OP_TIMEOUT))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ::redis::aio::ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| format!("store.backend: cannot set up the Redis client: {e}"))?;
        Ok(Redis {
            conn,
            prefix: prefix.to_owned(),
        })
    }

    fn key(&self, kind: &str, key: &str) -> String {
        format!("{}{kind}{key}", self.prefix)
    }

    /// Runs `cmd`; a connection-level failure (the connection died with a
    /// Redis restart, or the last reconnect failed while Redis was down) is
    /// retried once, on the connection the manager makes anew, before the
    /// store counts as down.
    async fn query<T: ::redis::FromRedisValue>(
        &self,
        cmd: &mut ::redis::Cmd,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        match cmd.query_async(&mut conn).await {
            Err(e) if connection_failed(&e) => cmd.query_async(&mut conn).await.map_err(failure),
            r => r.map_err(failure),
        }
    }

    async fn pipe<T: ::redis::FromRedisValue>(
        &self,
        pipe: &::redis::Pipeline,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        match pipe.query_async(&mut conn).await {
            Err(e) if connection_failed(&e) => pipe.query_async(&mut conn).await.map_err(failure),
            r => r.map_err(failure),
        }
    }
}

/// A failure of the connection rather than of the command: worth one more
/// try on a new connection. Reads and the idempotent writes (SET, SADD,
/// DEL) are safe to repeat. A session append (one MULTI/EXEC) that died
/// after Redis ran it but before its answer came back could be applied
/// twice; the same holds for a client that retries a cut response, and a
/// turn lost is worse than a turn doubled.
fn connection_failed(e: &::redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

/// A Redis error as the kind of failure it is.
fn failure(e: ::redis::RedisError) -> StoreError {
    use ::redis::ErrorKind;
    if connection_failed(&e) || e.is_timeout() {
        return StoreError::Unreachable(Arc::new(e));
    }
    match e.kind() {
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => StoreError::Corrupt(Arc::new(e)),
        _ => StoreError::Database(Arc::new(e)),
    }
}

/// One entry of a Redis stream as XREVRANGE gives it: its id, its fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

impl Backend for Redis {
    fn traits(&self) -> Traits {
        Traits {
            shared: true,
            probed_while_down: true,
            needed_tried_while_down: true,
            up_only_on_write: false,
        }
    }

    fn ping(&self, _write: bool) -> StoreFuture<'_, ()> {
        Box::pin(async {
            self.query::<String>(&mut ::redis::cmd("PING"))
                .await
                .map(drop)
        })
    }

    fn is_learned<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            self.query(
                ::redis::cmd("SISMEMBER")
                    .arg(self.key("learned", ""))
                    .arg(name),
            )
            .await
        })
    }

    fn learned(&self) -> StoreFuture<'_, Vec<String>> {
        Box::pin(async {
            self.query(::redis::cmd("SMEMBERS").arg(self.key("learned", "")))
                .await
        })
    }

    fn learn<'a>(&'a self, name: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.query::<i64>(::redis::cmd("SADD").arg(self.key("learned", "")).arg(name))
                .await
                .map(drop)
        })
    }

    fn description<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<String>> {
        Box::pin(async move {
            self.query(::redis::cmd("GET").arg(self.key("desc:", key)))
                .await
        })
    }

    fn put_description<'a>(&'a self, key: &'a str, text: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.query(
                ::redis::cmd("SET")
                    .arg(self.key("desc:", key))
                    .arg(text)
                    .arg("EX")
                    .arg(DESCRIPTION_TTL.as_secs()),
            )
            .await
        })
    }

    fn session<'a>(
        &'a self,
        key: &'a str,
        newest: usize,
        _ttl: Duration,
    ) -> StoreFuture<'a, Option<Vec<Bytes>>> {
        Box::pin(async move {
            let k = self.key("session:", key);
            let newest = i64::try_from(newest).unwrap_or(i64::MAX);
            let (exists, items): (bool, Vec<Vec<u8>>) = self
                .pipe(
                    ::redis::pipe()
                        .cmd("EXISTS")
                        .arg(&k)
                        .cmd("LRANGE")
                        .arg(&k)
                        .arg(-newest)
                        .arg(-1),
                )
                .await?;
            Ok(exists.then(|| items.into_iter().map(Bytes::from).collect()))
        })
    }

    fn append_session<'a>(
        &'a self,
        key: &'a str,
        messages: Vec<Bytes>,
        keep: usize,
        ttl: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let k = self.key("session:", key);
            let keep = i64::try_from(keep).unwrap_or(i64::MAX);
            let mut pipe = ::redis::pipe();
            pipe.atomic().cmd("RPUSH").arg(&k);
            for m in &messages {
                pipe.arg(m.as_ref());
            }
            pipe.ignore()
                .cmd("LTRIM")
                .arg(&k)
                .arg(-keep)
                .arg(-1)
                .ignore()
                .cmd("EXPIRE")
                .arg(&k)
                .arg(ttl.as_secs().max(1))
                .ignore();
            self.pipe::<()>(&pipe).await
        })
    }

    fn delete_session<'a>(&'a self, key: &'a str, _ttl: Duration) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            self.query::<i64>(::redis::cmd("DEL").arg(self.key("session:", key)))
                .await
                .map(|n| n > 0)
        })
    }

    /// Redis expires sessions itself.
    fn sweep_sessions(&self, _ttl: Duration) -> Option<StoreFuture<'_, usize>> {
        None
    }

    fn record<'a>(&'a self, key: &'a str) -> Option<StoreFuture<'a, Option<Vec<u8>>>> {
        Some(Box::pin(async move {
            self.query(::redis::cmd("GET").arg(self.key("cache:", key)))
                .await
        }))
    }

    fn put_record<'a>(
        &'a self,
        key: &'a str,
        value: Vec<u8>,
        ttl: Duration,
    ) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(async move {
            self.query(
                ::redis::cmd("SET")
                    .arg(self.key("cache:", key))
                    .arg(value)
                    .arg("EX")
                    .arg(ttl.as_secs().max(1)),
            )
            .await
        }))
    }

    fn publish_summary<'a>(&'a self, entry: Vec<u8>, keep: usize) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(async move {
            let _: ::redis::Value = self
                .query(
                    ::redis::cmd("XADD")
                        .arg(self.key("inspector:", "requests"))
                        .arg("MAXLEN")
                        .arg("~")
                        .arg(keep.max(1))
                        .arg("*")
                        .arg("s")
                        .arg(entry),
                )
                .await?;
            Ok(())
        }))
    }

    fn recent_summaries(&self, n: usize) -> Option<StoreFuture<'_, Vec<Vec<u8>>>> {
        Some(Box::pin(async move {
            let entries: Vec<StreamEntry> = self
                .query(
                    ::redis::cmd("XREVRANGE")
                        .arg(self.key("inspector:", "requests"))
                        .arg("+")
                        .arg("-")
                        .arg("COUNT")
                        .arg(n.max(1)),
                )
                .await?;
            Ok(entries
                .into_iter()
                .filter_map(|(_, fields)| {
                    fields.into_iter().find(|(k, _)| k == "s").map(|(_, v)| v)
                })
                .collect())
        }))
    }

    fn count_window<'a>(
        &'a self,
        requests_key: &'a str,
        requests: u64,
        tokens_key: &'a str,
        tokens: u64,
        ttl: Duration,
    ) -> Option<StoreFuture<'a, (u64, u64)>> {
        Some(Box::pin(async move {
            let mut cmd = ::redis::cmd("EVAL");
            cmd.arg(COUNT_WINDOW)
                .arg(2)
                .arg(self.key("limit:", requests_key))
                .arg(self.key("limit:", tokens_key))
                .arg(requests)
                .arg(tokens)
                .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
            self.query::<(u64, u64)>(&mut cmd).await
        }))
    }

    fn uncount_window<'a>(
        &'a self,
        tokens_key: &'a str,
        tokens: u64,
    ) -> Option<StoreFuture<'a, ()>> {
        Some(Box::pin(async move {
            let mut cmd = ::redis::cmd("EVAL");
            cmd.arg(UNCOUNT_WINDOW)
                .arg(1)
                .arg(self.key("limit:", tokens_key))
                .arg(tokens);
            self.query::<i64>(&mut cmd).await.map(drop)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_errors_are_told_apart() {
        use ::redis::{ErrorKind, RedisError};
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = failure(RedisError::from(refused));
        assert!(matches!(e, StoreError::Unreachable(_)), "{e:?}");
        let wrong = RedisError::from((ErrorKind::UnexpectedReturnType, "not a list"));
        let e = failure(wrong.clone());
        assert!(matches!(e, StoreError::Corrupt(_)), "{e:?}");
        // The text is the client's own, as before.
        assert_eq!(e.to_string(), wrong.to_string());
        let e = failure(RedisError::from((ErrorKind::Client, "bad argument")));
        assert!(matches!(e, StoreError::Database(_)), "{e:?}");
    }
}
