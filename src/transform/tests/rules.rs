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

#[test]
fn with_a_prompt_cache_ageing_never_raises_the_bill_without_one_it_ages_every_turn() {
    // Six turns, and sixty: ageing a screenshot already sent breaks the
    // cache for everything after it, and with a tenth-price cache that
    // never pays back in the request that does it, so nothing ages.
    let (body, _) = screenshots();
    let bytes = serde_json::to_vec(&body).unwrap();
    let r = rewrite(&bytes, &plan(Shape::Chat, true, DEFAULTS));
    assert_eq!(actions(&r.report), ["kept"; 7]);
    let long = screenshot_agent(60);
    for conversation in [&body, &long] {
        let (breaks, costs, _) = replay(conversation, DEFAULTS);
        assert!(breaks.iter().all(Option::is_none), "{breaks:?}");
        for (k, (with, without)) in costs.iter().enumerate() {
            assert!(
                with <= without,
                "request {k}: {with} > {without} billed tokens"
            );
        }
    }
    // Without a provider cache every token is paid every turn: screenshots
    // older than keep_turns go, each once, as soon as they are due.
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
    let last = &outs[outs.len() - 1];
    let msgs = last["messages"].as_array().unwrap();
    let aged = msgs
        .iter()
        .filter(|m| {
            m["content"]
                .as_str()
                .is_some_and(|c| c.contains("an older tool result"))
        })
        .count();
    assert_eq!(
        aged,
        60 - 3,
        "every screenshot with more than 2 assistant turns after it"
    );
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
    assert_eq!(Rules::new(&cfg.images, &cfg.dedup, None).max_images, 6);
    assert_eq!(Rules::new(&cfg.images, &cfg.dedup, Some(2)).max_images, 2);
    assert_eq!(Rules::new(&cfg.images, &cfg.dedup, Some(50)).max_images, 6);
    assert_eq!(
        Rules::new(&cfg.images, &cfg.dedup, Some(50)).hard_max_images,
        Some(50)
    );
    assert_eq!(
        Rules::new(&cfg.images, &cfg.dedup, None).hard_max_images,
        None
    );
    assert_eq!(Rules::new(&cfg.images, &cfg.dedup, None).dedup, None);
    // The rules built once at load, narrowed per model, are the rules
    // built for that model.
    let at_load = Rules::new(&cfg.images, &cfg.dedup, None);
    for cap in [None, Some(0), Some(2), Some(6), Some(50)] {
        assert_eq!(
            at_load.for_model(cap),
            Rules::new(&cfg.images, &cfg.dedup, cap),
            "{cap:?}"
        );
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
