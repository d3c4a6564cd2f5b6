//! The invariants of `visor::transform::rewrite` that the transform fuzz
//! targets check (`transform_bytes`, `transform_json`): those that
//! `src/transform/tests.rs`, `src/transform/tests_context.rs` and the
//! README state.

use serde_json::Value;
use visor::transform::{Plan, Rules, Shape, Takes, rewrite};

pub fn items_key(shape: Shape) -> &'static str {
    match shape {
        Shape::Responses => "input",
        _ => "messages",
    }
}

/// The plans a request goes through, with what each promises.
pub struct Check {
    pub plan: Plan,
    /// The model's own image limit, held for a model that can see.
    pub hard: Option<usize>,
    /// Run on its own output it changes nothing.
    pub idempotent: bool,
    /// No image is left.
    pub no_images: bool,
}

/// Four plans: the strip of a model that cannot see (no rule); the rules
/// for a model that can see (not re-applicable: an image kept because a
/// later copy refers to it, or because replacing it did not pay, may go
/// once the copy is text — so no idempotence there); line dedup alone for
/// a model that can see; the rules for a model that cannot see.
pub fn checks(shape: Shape, rules: Rules) -> Vec<Check> {
    let plan = |vision: bool, rules: Rules| Plan {
        shape,
        vision,
        describe: false,
        rules,
        takes: Takes::ALL,
        query_aware: false,
    };
    let dedup_only = Rules {
        dedup: rules.dedup,
        ..Rules::NONE
    };
    vec![
        Check {
            plan: Plan::images_only(shape, false, false),
            hard: None,
            idempotent: true,
            no_images: true,
        },
        Check {
            plan: plan(true, rules),
            hard: rules.hard_max_images,
            idempotent: false,
            no_images: false,
        },
        Check {
            plan: plan(true, dedup_only),
            hard: None,
            idempotent: true,
            no_images: false,
        },
        Check {
            plan: plan(false, rules),
            hard: None,
            idempotent: true,
            no_images: true,
        },
    ]
}

/// No image part and no base64 data URL left anywhere (as
/// `src/transform/tests.rs` checks it).
pub fn assert_no_images(v: &Value) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(t)) = m.get("type") {
                assert!(
                    !matches!(t.as_str(), "image_url" | "input_image" | "image"),
                    "image part left: {v}"
                );
            }
            m.values().for_each(assert_no_images);
        }
        Value::Array(a) => a.iter().for_each(assert_no_images),
        Value::String(s) => {
            assert!(!s.contains(";base64,"), "data URL left in {s:.200}");
            if let Ok(inner) = serde_json::from_str::<Value>(s)
                && (inner.is_object() || inner.is_array())
            {
                assert_no_images(&inner);
            }
        }
        _ => {}
    }
}

/// Role, type and ids of each message.
fn ids(v: &Value, key: &str) -> Vec<String> {
    let Some(items) = v[key].as_array() else {
        return Vec::new();
    };
    items
        .iter()
        .map(|m| {
            format!(
                "{}|{}|{}|{}|{}",
                m["role"],
                m["type"],
                m["tool_call_id"],
                m["call_id"],
                m["content"][0]["tool_use_id"]
            )
        })
        .collect()
}

fn untouchable(m: &Value) -> bool {
    matches!(
        m["role"].as_str(),
        Some("system" | "developer" | "assistant")
    ) || m["type"] == "function_call"
}

/// `n` is `o` but for image parts that became visor's text (a model that
/// cannot see takes no image anywhere, a system message included); their
/// texts are never looked into or deduped.
fn same_but_images(o: &Value, n: &Value) -> bool {
    let image = |p: &Value| {
        matches!(
            p["type"].as_str(),
            Some("image_url" | "input_image" | "image" | "file" | "image-data" | "image-url")
        )
    };
    let replaced = |p: &Value| {
        p["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("[image ") && !t.contains('\n'))
    };
    match (o, n) {
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len()
                && a
                    .iter()
                    .all(|(k, v)| b.get(k).is_some_and(|w| same_but_images(v, w)))
        }
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len()
                && a
                    .iter()
                    .zip(b)
                    .all(|(p, q)| p == q || (image(p) && replaced(q)) || same_but_images(p, q))
        }
        _ => o == n,
    }
}

fn empty(c: &Value) -> bool {
    match c {
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Null => true,
        _ => false,
    }
}

/// Runs `c.plan` on `body` (whose value is `before`) and checks the
/// invariants.
pub fn check(body: &[u8], before: &Value, shape: Shape, c: &Check) {
    let plan = &c.plan;
    let out = rewrite(body, plan);
    let again = rewrite(body, plan);
    assert_eq!(out.body, again.body, "not deterministic");
    let r = &out.report;
    assert!(r.images_replaced <= r.images_found && r.images_described == 0);
    let sent = out.body.as_deref().unwrap_or(body);
    let after: Value = match serde_json::from_slice(sent) {
        Ok(v) => v,
        Err(e) => panic!(
            "rewrite is not JSON ({e}): {}",
            String::from_utf8_lossy(sent)
        ),
    };
    if out.body.is_some() {
        assert_eq!(r.bytes_saved, body.len() as i64 - sent.len() as i64);
    }
    let key = items_key(shape);
    // Everything but the messages stays as it was.
    let (mut a, mut b) = (before.clone(), after.clone());
    if let (Some(a), Some(b)) = (a.as_object_mut(), b.as_object_mut()) {
        a.remove(key);
        b.remove(key);
    }
    assert_eq!(a, b, "fields other than the messages changed");
    assert_eq!(
        ids(&after, key),
        ids(before, key),
        "messages, roles or ids changed"
    );
    if let (Some(old), Some(new)) = (before[key].as_array(), after[key].as_array()) {
        for (o, n) in old.iter().zip(new) {
            if untouchable(o) {
                assert!(
                    same_but_images(o, n),
                    "a system, developer or assistant message changed: {o} -> {n}"
                );
            }
            assert!(
                empty(&o["content"]) || !empty(&n["content"]),
                "{o} left empty: {n}"
            );
        }
    }
    if c.no_images {
        assert_no_images(&after[key]);
    }
    if let Some(h) = c.hard {
        let kept = r.images.iter().filter(|n| n.action == "kept").count();
        assert!(kept <= h, "{kept} images kept over the model's limit {h}");
    }
    if !c.idempotent {
        return;
    }
    let twice = rewrite(sent, plan);
    if plan.rules == Rules::NONE {
        // The strip: a second pass finds nothing to do.
        assert!(twice.body.is_none(), "strip is not idempotent");
    }
    if let Some(t) = &twice.body {
        let t: Value = serde_json::from_slice(t).unwrap_or(Value::Null);
        assert_eq!(t, after, "a second pass changed the rewrite");
    }
}
