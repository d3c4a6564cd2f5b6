//! Session histories in each store backend — memory, disk (redb, across a
//! reopen) and a real `redis-server` (skipped with a printed reason when it
//! is not installed, except under CI=true): appends land whole and in one
//! piece, only the newest `keep` stay, 50 appends at once lose nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use support::*;
use visor::config::StoreBackend;
use visor::metrics::Metrics;
use visor::store::Store;

const DAY: Duration = Duration::from_secs(86_400);

fn b(t: &str) -> Bytes {
    Bytes::from(t.to_owned())
}

/// What every backend must do with sessions (keys made unique by `tag`).
async fn sessions_behave(s: Arc<Store>, tag: &str) {
    let (k1, k2, k3) = (format!("{tag}1"), format!("{tag}2"), format!("{tag}3"));
    assert_eq!(s.session(&k1, 10, DAY).await.unwrap(), None);
    s.append_session(&k1, vec![b("a"), b("b")], 3, DAY)
        .await
        .unwrap();
    assert_eq!(
        s.session(&k1, 10, DAY).await.unwrap(),
        Some(vec![b("a"), b("b")])
    );
    assert_eq!(s.session(&k1, 1, DAY).await.unwrap(), Some(vec![b("b")]));
    s.append_session(&k1, vec![b("c"), b("d")], 3, DAY)
        .await
        .unwrap();
    assert_eq!(
        s.session(&k1, 10, DAY).await.unwrap(),
        Some(vec![b("b"), b("c"), b("d")]),
        "only the newest `keep` are kept"
    );
    assert_eq!(
        s.session(&k2, 10, DAY).await.unwrap(),
        None,
        "sessions are apart"
    );
    // 50 appends at once: every pair lands whole, none lost or doubled.
    let mut tasks = Vec::new();
    for i in 0..50 {
        let (s, k3) = (s.clone(), k3.clone());
        tasks.push(tokio::spawn(async move {
            let pair = vec![Bytes::from(format!("u{i}")), Bytes::from(format!("r{i}"))];
            s.append_session(&k3, pair, 1000, DAY).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let all = s.session(&k3, 1000, DAY).await.unwrap().unwrap();
    assert_eq!(all.len(), 100);
    let mut seen = std::collections::HashSet::new();
    for pair in all.chunks(2) {
        let u = String::from_utf8(pair[0].to_vec()).unwrap();
        let r = String::from_utf8(pair[1].to_vec()).unwrap();
        assert_eq!(
            u.replace('u', "r"),
            r,
            "a reply right after its own message"
        );
        assert!(seen.insert(u));
    }
    assert!(s.delete_session(&k1, DAY).await.unwrap());
    assert_eq!(s.session(&k1, 10, DAY).await.unwrap(), None);
    assert!(!s.delete_session(&k1, DAY).await.unwrap());
}

fn metrics() -> Arc<Metrics> {
    Arc::new(Metrics::new().unwrap())
}

#[tokio::test]
async fn sessions_in_memory() {
    let s = Arc::new(Store::memory(metrics()));
    sessions_behave(s.clone(), "m").await;
    assert_eq!(s.sweep_sessions(DAY).await.unwrap(), 0);
    assert!(s.session("m3", 1, DAY).await.unwrap().is_some());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while s.sweep_sessions(Duration::ZERO).await.unwrap() == 0 {
        assert!(std::time::Instant::now() < deadline, "never swept");
        tokio::task::yield_now().await;
    }
    assert_eq!(s.session("m3", 1, DAY).await.unwrap(), None);
}

#[tokio::test]
async fn sessions_on_disk_survive_a_reopen() {
    let dir = temp_dir("sessions-disk");
    {
        let s = Arc::new(Store::open(&StoreBackend::Disk, "visor:", &dir, metrics()).unwrap());
        sessions_behave(s.clone(), "d").await;
        s.append_session("kept", vec![b("m")], 10, DAY)
            .await
            .unwrap();
    }
    let s = Store::open(&StoreBackend::Disk, "visor:", &dir, metrics()).unwrap();
    assert_eq!(
        s.session("kept", 10, DAY).await.unwrap(),
        Some(vec![b("m")])
    );
    // The sweep keeps what is not idle, and forgets what is (the disk store
    // counts whole seconds: wait, bounded, until "kept" is a second old).
    assert_eq!(s.sweep_sessions(DAY).await.unwrap(), 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    // (Sessions written in an earlier second may go first: sweep until
    // "kept" itself is gone.)
    loop {
        s.sweep_sessions(Duration::ZERO).await.unwrap();
        if s.session("kept", 10, DAY).await.unwrap().is_none() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never swept");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn sessions_on_redis_are_shared_and_expire() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let prefix = format!("visor-sessions-{}:", std::process::id());
    let dir = temp_dir("sessions-redis");
    let s =
        Arc::new(Store::open(&StoreBackend::Redis(redis.url()), &prefix, &dir, metrics()).unwrap());
    sessions_behave(s.clone(), "r").await;
    // A second client (another replica) sees the same history.
    let other = Store::open(&StoreBackend::Redis(redis.url()), &prefix, &dir, metrics()).unwrap();
    s.append_session("shared", vec![b("x")], 10, DAY)
        .await
        .unwrap();
    assert_eq!(
        other.session("shared", 10, DAY).await.unwrap(),
        Some(vec![b("x")])
    );
    // The idle TTL is Redis's own expiry on the list.
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let ttl: i64 = redis::cmd("TTL")
        .arg(format!("{prefix}session:shared"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!((86_000..=86_400).contains(&ttl), "{ttl}");
}
