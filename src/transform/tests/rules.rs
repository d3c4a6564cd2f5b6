//! The image rules for every model (`rules.rs`): ageing, caps, the
//! model's hard limit, later copies, and what each costs with and without
//! a prompt cache.

use serde_json::{Value, json};

use crate::transform::decode::sha256_hex;
use crate::transform::*;

use super::support::*;

#[test]
fn an_image_a_later_copy_refers_to_never_ages_out() {
    let long = screenshot_agent(12);
    let mut msgs = long["messages"].as_array().unwrap().clone();
    // The user sends the first screenshot again right after it.
    let first = msgs[2]["content"][1].clone();
    msgs.insert(
        3,
        json!({"role": "user", "content": [{"type": "text", "text": "this one"}, first]}),
    );
    let body = json!({"model": "gpt-4o", "messages": msgs});
    let rules = Rules {
        prompt_cache: false,
        ..DEFAULTS
    };
    let bytes = serde_json::to_vec(&body).unwrap();
    let acts = actions(&rewrite(&bytes, &plan(Shape::Chat, true, rules)).report);
    assert_eq!(
        acts[1], "kept",
        "the screenshot the copy points at stays: {acts:?}"
    );
    assert_eq!(acts[2], "deduped");
    assert_eq!(acts[3], "aged_out", "the others age as before: {acts:?}");
}

/// The break-even rule of `rules.rs`, worked out here on its own from the
/// cost model (text at 4 bytes a token, an image 765 tokens, its
/// replacement 40, cached input a tenth), for a conversation whose
/// requests end after each user message and tool result: the requests
/// (by index) where the screenshots due age out, and which.
fn break_even_rewrites(body: &Value, keep_turns: usize) -> Vec<(usize, Vec<usize>)> {
    let msgs = body["messages"].as_array().unwrap();
    let is_image = |p: &Value| p["type"] == "image_url";
    let text_tokens = |m: &Value| {
        let mut m = m.clone();
        if let Some(parts) = m["content"].as_array_mut() {
            parts.retain(|p| !is_image(p));
        }
        serde_json::to_vec(&m).unwrap().len() / 4
    };
    let has_image = |m: &Value| {
        m["content"]
            .as_array()
            .is_some_and(|p| p.iter().any(is_image))
    };
    let ends: Vec<usize> = (0..msgs.len())
        .filter(|&k| matches!(msgs[k]["role"].as_str(), Some("user" | "tool")))
        .map(|k| k + 1)
        .collect();
    // Per message holding a tool image: aged, and the request it became
    // due at.
    let mut aged = vec![false; msgs.len()];
    let mut due_at: Vec<Option<usize>> = vec![None; msgs.len()];
    let mut rewrites = Vec::new();
    for (j, &end) in ends.iter().enumerate().skip(1) {
        let prev_end = ends[j - 1];
        let due: Vec<usize> = (0..prev_end)
            .filter(|&m| msgs[m]["role"] == "tool" && has_image(&msgs[m]) && !aged[m])
            .filter(|&m| {
                let after = (m + 1..end)
                    .filter(|&k| msgs[k]["role"] == "assistant")
                    .count();
                after > keep_turns
            })
            .collect();
        let Some(&first) = due.first() else {
            continue;
        };
        // Keeping an image due costs a tenth of (765 − 40) a request.
        let rent: f64 = due
            .iter()
            .map(|&m| (j - *due_at[m].get_or_insert(j)) as f64 * 72.5)
            .sum();
        // The rewrite: the suffix at full price, changed, instead of cached.
        let (mut cached, mut rewritten) = (0.0, 0.0);
        for m in first..prev_end {
            let t = text_tokens(&msgs[m]) as f64;
            let kept = has_image(&msgs[m]) && !aged[m];
            cached += (t + if kept { 765.0 } else { 40.0 }) / 10.0;
            rewritten += t + if kept && !due.contains(&m) {
                765.0
            } else {
                40.0
            };
        }
        if rent >= rewritten - cached {
            for &m in &due {
                aged[m] = true;
            }
            rewrites.push((j, due));
        }
    }
    rewrites
}

/// The screenshots (by message) a request sends replaced.
fn aged_messages(out: &Value) -> Vec<usize> {
    let msgs = out["messages"].as_array().unwrap();
    (0..msgs.len())
        .filter(|&m| {
            msgs[m]["content"]
                .as_str()
                .is_some_and(|c| c.contains("an older tool result"))
        })
        .collect()
}

#[test]
fn with_a_prompt_cache_the_due_screenshots_age_together_at_the_break_even() {
    let long = screenshot_agent(60);
    let expected = break_even_rewrites(&long, DEFAULTS.keep_turns);
    assert!(
        expected.len() >= 3 && expected[0].0 > 4,
        "a few rewrites, not one a turn nor at the first due: {expected:?}"
    );
    let p = plan(Shape::Chat, true, DEFAULTS);
    let mut previous: Option<Value> = None;
    let mut rewrites = Vec::new();
    for (j, req) in turns(&long).iter().enumerate() {
        let (out, _) = run(req, &p);
        let msgs = out["messages"].as_array().unwrap();
        if let Some(prev) = &previous {
            let prev = prev["messages"].as_array().unwrap();
            if msgs[..prev.len()] != prev[..] {
                rewrites.push((j, aged_messages(&out)));
                // All the screenshots due go in this one rewrite; none that
                // went before comes back.
                let was = aged_messages(&previous.clone().unwrap());
                assert!(was.iter().all(|m| aged_messages(&out).contains(m)));
            }
        }
        previous = Some(out);
    }
    // The same turns as the rule worked out above, each ageing every
    // screenshot due then (and those aged before); the sent prefix is
    // unchanged on every other turn.
    let mut so_far = Vec::new();
    let expected: Vec<(usize, Vec<usize>)> = expected
        .into_iter()
        .map(|(j, due)| {
            so_far.extend(due);
            (j, so_far.clone())
        })
        .collect();
    assert_eq!(rewrites, expected);
    // Billed with a tenth-price cache, the 60 turns cost less than sent
    // unchanged.
    let (_, costs, _) = replay(&long, DEFAULTS);
    let (with, without) = costs[costs.len() - 1];
    assert!(with < without * 0.7, "{with} of {without}");
}

#[test]
fn near_the_context_window_the_due_screenshots_age_whatever_the_cache() {
    let long = screenshot_agent(30);
    let requests = turns(&long);
    // What the rules estimate a request, nothing replaced, to be.
    let estimate = |req: &Value| -> usize {
        req["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let mut m = m.clone();
                let mut images = 0;
                if let Some(parts) = m["content"].as_array_mut() {
                    let before = parts.len();
                    parts.retain(|p| p["type"] != "image_url");
                    images = before - parts.len();
                }
                serde_json::to_vec(&m).unwrap().len() / 4 + images * 765
            })
            .sum()
    };
    // Request 6 passes 0.8 of the window, request 5 does not.
    let (e5, e6) = (estimate(&requests[5]), estimate(&requests[6]));
    let window = ((e5 + e6) / 2 * 10 / 8) as u64;
    let near = Rules {
        context_window: Some(window),
        ..DEFAULTS
    };
    let (breaks, _, _) = replay(&long, near);
    let first = breaks.iter().position(Option::is_some).map(|k| k + 1);
    assert_eq!(first, Some(6), "{breaks:?}");
    let by_cost = break_even_rewrites(&long, DEFAULTS.keep_turns);
    assert!(by_cost[0].0 > 6, "the cost alone waits longer: {by_cost:?}");
    // A window every request passes: the screenshots age the turn they
    // are due, as without a cache; one none passes changes nothing.
    let uncached = Rules {
        prompt_cache: false,
        ..DEFAULTS
    };
    for (rules, same_as) in [
        (Some(1000), uncached),
        (Some(10_000_000), DEFAULTS),
        (None, DEFAULTS),
    ] {
        let with_window = Rules {
            context_window: rules,
            ..DEFAULTS
        };
        assert_eq!(
            replay(&long, with_window).2,
            replay(&long, same_as).2,
            "{rules:?}"
        );
    }
    // The fraction is the config's: at 1.0 request 6 is not past it.
    let whole = Rules {
        context_permille: 1000,
        ..near
    };
    let (breaks, _, _) = replay(&long, whole);
    assert_ne!(
        breaks.iter().position(Option::is_some).map(|k| k + 1),
        Some(6)
    );
}

#[test]
fn without_a_prompt_cache_every_screenshot_ages_the_turn_it_is_due() {
    // Without a provider cache every token is paid every turn: screenshots
    // older than keep_turns go, each once, as soon as they are due.
    let long = screenshot_agent(60);
    let uncached = Rules {
        prompt_cache: false,
        ..DEFAULTS
    };
    let (breaks, costs, outs) = replay(&long, uncached);
    assert!(breaks.iter().flatten().count() >= 50, "{breaks:?}");
    for (k, (with, without)) in costs.iter().enumerate() {
        assert!(
            with <= without,
            "request {k}: {with} > {without} billed tokens"
        );
    }
    let (with, without) = costs[costs.len() - 1];
    assert!(with < without * 0.5, "{with} of {without}");
    for (k, out) in outs.iter().enumerate() {
        // Request k holds screenshots 0..k; those with more than 2
        // assistant turns after them (0..k-3) are aged.
        assert_eq!(
            aged_messages(out),
            (0..k.saturating_sub(3))
                .map(|t| 2 * t + 2)
                .collect::<Vec<_>>(),
            "request {k}"
        );
    }
    let last = &outs[outs.len() - 1];
    let msgs = last["messages"].as_array().unwrap();
    assert_eq!(msgs[0], long["messages"][0], "the user's image stays");
    for (m, o) in msgs.iter().zip(long["messages"].as_array().unwrap()) {
        assert_eq!(m["tool_call_id"], o["tool_call_id"]);
    }
    let again = rewrite(
        &serde_json::to_vec(last).unwrap(),
        &plan(Shape::Chat, true, uncached),
    );
    assert_eq!(
        again.body, None,
        "running it on its own output changes nothing"
    );
}

#[test]
fn the_models_hard_limit_caps_down_to_half_the_newest_screenshot_stays() {
    let (body, _) = screenshots();
    let hard = Rules {
        max_images: 3,
        hard_max_images: Some(3),
        ..DEFAULTS
    };
    let (breaks, _, outs) = replay(&body, hard);
    for out in &outs {
        let msgs = out["messages"].as_array().unwrap();
        let kept = msgs
            .iter()
            .filter_map(|m| m["content"].as_array())
            .flat_map(|p| p.iter().filter(|p| p["type"] == "image_url"))
            .count();
        assert!(kept <= 3, "{kept} images sent");
        let newest = &msgs[msgs.len() - 1];
        if newest["role"] == "tool" {
            assert!(
                newest["content"].is_array(),
                "the newest screenshot is sent"
            );
        }
    }
    assert_eq!(
        breaks.iter().flatten().count(),
        2,
        "capping to half of the limit at once: two breaks in six turns, not one a turn: {breaks:?}"
    );
    // max_per_request alone is not a hard limit: capping an image already
    // sent does not pay in six turns.
    let soft = Rules {
        max_images: 3,
        ..DEFAULTS
    };
    let (breaks, _, _) = replay(&body, soft);
    assert!(breaks.iter().all(Option::is_none), "{breaks:?}");
    // Images that arrive together over the limit are capped at once,
    // oldest first.
    let capped = |max| {
        let rules = Rules {
            keep_turns: usize::MAX,
            max_images: max,
            hard_max_images: Some(max),
            ..DEFAULTS
        };
        let mut b = body.clone();
        // One request holding every image: the user's message carries them.
        let parts: Vec<Value> = b["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["content"].as_array())
            .flat_map(|p| p.iter().filter(|p| p["type"] == "image_url").cloned())
            .collect();
        b["messages"] = json!([{"role": "user", "content": parts}]);
        actions(
            &rewrite(
                &serde_json::to_vec(&b).unwrap(),
                &plan(Shape::Chat, true, rules),
            )
            .report,
        )
    };
    assert_eq!(capped(10), ["kept"; 7]);
    assert_eq!(
        capped(3),
        [
            "capped", "capped", "capped", "capped", "kept", "kept", "kept"
        ]
    );
}

#[test]
fn the_models_max_images_wins_when_smaller() {
    let cfg = crate::config::Config::from_toml(
        "[[upstream]]\nname = \"u\"\nbase_url = \"http://127.0.0.1:9/v1\"\n[images]\nmax_per_request = 6\n[dedup]\nenabled = false\n",
        std::path::Path::new("test.toml"),
        &|_| None,
    )
    .unwrap();
    let new = |cap, window| Rules::new(&cfg.images, &cfg.dedup, cap, window);
    assert_eq!(new(None, None).max_images, 6);
    assert_eq!(new(Some(2), None).max_images, 2);
    assert_eq!(new(Some(50), None).max_images, 6);
    assert_eq!(new(Some(50), None).hard_max_images, Some(50));
    assert_eq!(new(None, None).hard_max_images, None);
    assert_eq!(new(None, None).dedup, None);
    assert_eq!(new(None, None).context_permille, 800);
    assert_eq!(new(None, Some(128_000)).context_window, Some(128_000));
    // The rules built once at load, narrowed per model, are the rules
    // built for that model.
    let at_load = new(None, None);
    for cap in [None, Some(0), Some(2), Some(6), Some(50)] {
        for window in [None, Some(8_192), Some(128_000)] {
            assert_eq!(
                at_load.for_model(cap, window),
                new(cap, window),
                "{cap:?} {window:?}"
            );
        }
    }
}

#[test]
fn a_later_copy_of_an_image_becomes_a_reference() {
    let (body, pngs) = screenshots();
    let url = body["messages"][0]["content"][1]["image_url"]["url"].clone();
    let mut b = body.clone();
    // Two more turns whose screenshots are the user's mockup again.
    for t in 6..8 {
        let id = format!("call_render_{t}");
        b["messages"].as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "render_page", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": [{"type": "text", "text": "Rendered."}, {"type": "image_url", "image_url": {"url": url}}]}),
        ]);
    }
    let bytes = serde_json::to_vec(&b).unwrap();
    let r = rewrite(&bytes, &plan(Shape::Chat, true, DEFAULTS));
    let acts = actions(&r.report);
    assert_eq!(&acts[7..], ["deduped", "deduped"]);
    let out: Value = serde_json::from_slice(r.body.as_deref().unwrap()).unwrap();
    let sha = sha256_hex(&pngs[0]);
    assert_eq!(
        out["messages"][14]["content"],
        format!(
            "Rendered.\n[image sha256:{}: the same image as earlier in this conversation]",
            &sha[..12]
        )
    );
    assert_eq!(out["messages"][0], b["messages"][0], "the first copy stays");
    assert!(r.artifacts.iter().any(|a| a.sha256 == sha));
    let off = rewrite(
        &bytes,
        &plan(
            Shape::Chat,
            true,
            Rules {
                dedupe: false,
                ..DEFAULTS
            },
        ),
    );
    assert_eq!(&actions(&off.report)[7..], ["kept", "kept"]);
}

#[test]
fn a_text_only_model_never_ages_an_image_its_text_never_changes() {
    let long = screenshot_agent(40);
    let bytes = serde_json::to_vec(&long).unwrap();
    let p = Plan {
        describe: true,
        ..plan(Shape::Chat, false, DEFAULTS)
    };
    let scanned = scan(&bytes, &p).unwrap();
    assert!(
        scanned
            .fates()
            .iter()
            .all(|f| *f == Fate::Replaced(Reason::NonVision)),
        "ageing a replaced image saves nothing and would change its text"
    );
    assert!(scanned.subjects(&bytes).iter().all(|(_, s)| !s.lookup_only));
    let r = scanned.finish(&bytes, &[]);
    assert_eq!(r.report.images_replaced, 41);
    assert_eq!(
        actions(&r.report)
            .iter()
            .filter(|a| **a == "stripped")
            .count(),
        41
    );
}

/// A computer-use agent on the Responses API: its screenshots come back as
/// `computer_call_output` items and are capped like any tool image.
#[test]
fn computer_use_screenshots_are_capped_and_deduped() {
    let (_, pngs) = screenshots();
    let mut input = vec![json!({"role": "user", "content": "book a flight"})];
    for i in 0..6 {
        let mut png = pngs[1].clone();
        png.extend_from_slice(format!("screen {i}").as_bytes());
        let url = format!(
            "data:image/png;base64,{}",
            base64_simd::STANDARD.encode_to_string(&png)
        );
        input.push(json!({"type": "computer_call", "call_id": format!("c{i}"), "action": {"type": "screenshot"}}));
        input.push(json!({"type": "computer_call_output", "call_id": format!("c{i}"), "output": {"type": "computer_screenshot", "image_url": url}}));
    }
    // The same screen twice in a row: the later copy refers to the first.
    let again = input[12]["output"].clone();
    input.push(json!({"type": "computer_call", "call_id": "c9", "action": {"type": "screenshot"}}));
    input.push(json!({"type": "computer_call_output", "call_id": "c9", "output": again}));
    let body = json!({"model": "computer-use-preview", "input": input});
    let rules = Rules {
        max_images: 3,
        hard_max_images: Some(3),
        ..DEFAULTS
    };
    let (out, report) = run(&body, &plan(Shape::Responses, true, rules));
    let kept = out["input"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["output"]["type"] == "computer_screenshot")
        .count();
    assert!(kept <= 3, "{kept} screenshots sent");
    assert!(report.images_replaced >= 4, "{report:?}");
    let last = &out["input"][out["input"].as_array().unwrap().len() - 1];
    assert_eq!(
        last["output"]["type"], "input_text",
        "the repeat is a reference"
    );
    assert_eq!(last["call_id"], "c9");
}
