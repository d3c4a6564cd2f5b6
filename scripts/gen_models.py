#!/usr/bin/env python3
"""Builds config/models.toml, the built-in model-spec table, from
scripts/data/model-capabilities.tsv (public capability facts from litellm)
plus hand-written rows for well-known text-only families the source leaves
blank.

    python3 scripts/gen_models.py [TSV [PRICES_TSV]] > config/models.toml

Names are normalised the way visor normalises a requested model (see
`src/models.rs`, `candidates`): lower case, provider path and dotted vendor
prefix dropped, version / date / tag suffixes dropped. Rows are then folded
into family globs `prefix*` wherever every stated name under the prefix
agrees on `vision`; names with no agreeing family stay exact. An empty cell
means "not stated" and never counts as false. The script checks that every
stated name resolves to its stated value through the finished table (first
match wins) and fails otherwise.

A name carrying a vision marker (`vl`, `vision`, `omni`, `llava`, a `v`
glued to the version as in `glm-4.5v`…) is decided by the marker in visor
before any built-in row (`src/models.rs`, `vision_marker`); `marker` below
is the same rule, so the check knows it and no row is spent on such names.
DOCUMENTED rows are placed above the data's own exceptions: they hold facts
read in the publishers' documentation that some host's entry in the data
contradicts.

CACHE_MIN_TOKENS rows come last and state only `cache_min_tokens`, the
shortest prompt prefix (in tokens) the provider caches, read in each
provider's prompt caching documentation. Every field is taken from the
first row that states it, so these rows decide nothing else wherever they
sit; among themselves the first match wins, and the script checks a few
real names (CACHE_CHECKS) against them the way visor matches a name.

LIMIT rows follow them and state only a provider's documented image and
request limits (`max_image_bytes`, `max_image_edge`, `max_image_pixels`,
`max_request_bytes`, `many_images`, `many_images_edge`) and its image
token formula (`image_tokens`), each group with the page it comes from.
They too decide nothing else, and the script checks real names
(LIMIT_CHECKS) against them field by field, the way visor merges rows.

PRICE rows come after them and state only prices per million tokens
(`input`, `cached_input`, `cache_write`, `output`), from
scripts/data/model-prices.tsv: litellm's per-token costs
(`input_cost_per_token`, `cache_read_input_token_cost`,
`cache_creation_input_token_cost`, `output_cost_per_token`) for its chat
and responses models, extracted from the model map bundled in a litellm
release on PyPI by

    python3 scripts/gen_models.py --extract-prices \
        .../litellm/model_prices_and_context_window_backup.json \
        > scripts/data/model-prices.tsv

(scripts/data/README.md says which release and how). Each row is an exact
normalised name, never a family glob: the members of a family cost
different amounts (gpt-4o, gpt-4o-mini). How one price is chosen where
several entries normalise to one name is said beside `price_rows`.
"""
import csv
import fnmatch
import json
import re
import sys
from collections import Counter, defaultdict
from decimal import Decimal

SEPS = "-._:@"
REGION = re.compile(r"^(us|eu|apac|global|jp|au|ca|us-gov)\.")
VENDOR = re.compile(r"^[a-z][a-z0-9_-]*\.(?=[a-z])")
SUFFIXES = [
    re.compile(r":[a-z0-9._-]*$"),
    re.compile(r"-v\d+$"),
    re.compile(r"@[0-9a-z-]*$"),
    re.compile(r"-\d{4}-\d{2}-\d{2}$"),
    re.compile(r"-\d{8}$"),
    re.compile(r"-\d{4}$"),
    re.compile(r"-latest$"),
]

# Facts from the publishers' documentation (model cards, API docs) that win
# over a host's contrary entry in the data. First match wins.
DOCUMENTED = [
    # Gemma 3: 1B and 270M are text-only; 4B and up take images (Google's
    # Gemma docs and model card).
    ("gemma-3-1b*", False), ("gemma3-1b*", False), ("gemma3:1b*", False),
    ("gemma-3-270m*", False), ("gemma3-270m*", False), ("gemma3:270m*", False),
    # Llama 4 Scout / Maverick are natively multimodal (Meta's model card).
    ("llama-4*", True), ("llama4*", True), ("llama-v4*", True),
    # Kimi K2.5 added a vision encoder to K2 (Moonshot; vLLM's kimi_k25);
    # K2 / K2-Instruct / K2-Thinking are text-only.
    ("kimi-k2.5*", True), ("kimi-k2p5*", True),
    # Qwen3.5 is one vision-language family (Qwen model cards, SGLang's
    # cookbook); Qwen3 and Qwen3-Coder are text-only.
    ("qwen3.5*", True), ("qwen3p5*", True), ("qwen3_5*", True),
    # Ministral 3 (2512): every size has a vision encoder (Mistral's cards).
    ("ministral-3-*", True), ("ministral-3:*", True), ("ministral-*-2512*", True),
    # Mistral Large 3 (2512) is multimodal; Large 2 (2407, 2411) is not.
    ("mistral-large-3*", True), ("mistral-large-2512*", True),
    # Devstral Small 2 takes images; Devstral Small 1.x (2505, 2507) does
    # not (Mistral; a community vision graft exists for 1.0 only).
    ("devstral-small-2", True), ("devstral-small-2-*", True),
    ("devstral-small-2:*", True), ("devstral-small-2512*", True),
    ("devstral-small-2505*", False), ("devstral-small-2507*", False),
    # gpt-oss is text-only (OpenAI's model card).
    ("gpt-oss*", False),
]

# Well-known families the source leaves blank (or states only for some
# hosts). First match wins, so the vision exceptions come before the
# text-only families they sit in.
MANUAL = [
    # vision members of otherwise text-only families
    ("*-vl-*", True), ("*-vl", True), ("*vision*", True), ("qvq*", True),
    ("pixtral*", True), ("llava*", True), ("llama-4*", True), ("llama4*", True),
    ("qwen*-omni*", True), ("mistral-small-3.1*", True), ("mistral-small-3.2*", True),
    ("mistral-medium-3*", True), ("mistral-small3.1*", True), ("mistral-small3.2*", True),
    ("gemma-3-*", True), ("gemma3*", True), ("gemma-3n*", True), ("minicpm-v*", True),
    # text-only
    ("gpt-4", False), ("gpt-4-32k*", False), ("gpt-4-0125-preview", False),
    ("gpt-4-1106-preview", False), ("gpt-3.5*", False), ("gpt-35*", False), ("gpt-oss*", False),
    ("o1-mini*", False), ("o3-mini*", False), ("o1-preview*", False),
    ("deepseek-chat*", False), ("deepseek-reasoner*", False), ("deepseek-coder*", False),
    ("deepseek-r1*", False), ("deepseek-v3*", False), ("deepseek-v2*", False),
    ("llama-2*", False), ("llama2*", False), ("llama-3-*", False), ("llama3-*", False),
    ("llama-3.1*", False), ("llama3.1*", False), ("llama-3.2-1b*", False),
    ("llama-3.2-3b*", False), ("llama3.2*", False), ("llama-3.3*", False),
    ("llama3.3*", False), ("llama-v3*", False), ("meta-llama-3*", False),
    ("codellama*", False), ("qwen2.5*", False), ("qwen2-*", False), ("qwen3-*", False),
    ("qwen3*", False), ("qwq*", False), ("qwen-turbo*", False), ("qwen-plus*", False),
    ("qwen-max*", False), ("qwen2.5-coder*", False), ("qwen3-coder*", False),
    ("mistral-7b*", False), ("mixtral*", False), ("mistral-nemo*", False),
    ("open-mistral*", False), ("open-mixtral*", False), ("codestral*", False),
    ("ministral*", False), ("mistral-tiny*", False), ("mistral-large-2*", False),
    ("phi-3*", False), ("phi-4*", False), ("gemma-2*", False), ("gemma2*", False),
    ("command-r*", False), ("yi-*", False), ("glm-4-*", False), ("kimi-k2*", False),
    # this year's text-only families (their vision members carry a marker:
    # glm-4.5v, glm-5v-turbo, qwen3-vl-*, deepseek-v4-flash-vision-exp)
    ("deepseek-v4-pro*", False), ("glm-4.5*", False), ("glm-4p5*", False),
    ("glm-4.6*", False), ("glm-4p6*", False), ("glm-4.7*", False), ("glm-4p7*", False),
    ("glm-5*", False), ("minimax-m2*", False), ("qwen3-coder*", False),
    ("qwen3-next*", False), ("devstral-medium*", False),
]


# The shortest prefix each provider caches (`cache_min_tokens`), by model
# family; visor assumes 1024 for a model no row states. Each group: the
# documentation page it comes from, then (glob, tokens), first match wins,
# so a model comes before a family glob that would also catch it. `[.-]`
# takes both spellings of a version (claude-opus-4-5, claude-opus-4.5); a
# leading `*` takes a host's prefix on the name (anthropic/, databricks-).
CACHE_MIN_TOKENS = [
    (
        # Anthropic lists one minimum per model under "Cache limitations";
        # these are the Claude API's figures as the page stood in October
        # 2026. Bedrock publishes its own (there Fable 5 and Mythos 5 need
        # 1,024), so a Bedrock upstream may want a [[model]] row of its own.
        # Haiku 3, Sonnet 3.5 / 3.7 and Opus 3 are taken from earlier
        # versions of the page, listed there before those models retired.
        "Anthropic: https://platform.claude.com/docs/en/build-with-claude/prompt-caching",
        [
            ("*claude-opus-5*", 512), ("*claude-sonnet-5[.-]5*", 512),
            ("*claude-haiku-5[.-]5*", 512), ("*claude-fable-5*", 512),
            ("*claude-mythos-5*", 512),
            ("*claude-mythos-preview*", 2048), ("*claude-opus-4[.-]7*", 2048),
            ("*claude-opus-4[.-]5*", 4096), ("*claude-opus-4[.-]6*", 4096),
            ("*claude-haiku-4[.-]5*", 4096), ("*claude-4[.-]5-haiku*", 4096),
            ("*claude-opus-4[.-]8*", 1024), ("*claude-opus-4[.-]1*", 1024),
            ("*claude-opus-4[.-]0*", 1024), ("*claude-opus-4", 1024),
            ("*claude-4-opus*", 1024), ("*claude-4[.-]1-opus*", 1024),
            ("*claude-sonnet-5*", 1024), ("*claude-sonnet-4*", 1024),
            ("*claude-4*-sonnet*", 1024),
            ("*claude-3[.-]5-haiku*", 2048), ("*claude-3-haiku*", 2048),
            ("*claude-3[.-]5-sonnet*", 1024), ("*claude-3[.-]7-sonnet*", 1024),
            ("*claude-3-opus*", 1024),
        ],
    ),
    (
        # OpenAI caches on its own for gpt-4o and every later model, from
        # 1,024 prompt tokens up (the default; GPT-5.6 and later also take
        # explicit breakpoints).
        "OpenAI: https://developers.openai.com/api/docs/guides/prompt-caching",
        [
            ("*gpt-4o*", 1024), ("*gpt-4.1*", 1024), ("*gpt-5*", 1024),
            ("*gpt-6*", 1024), ("o1*", 1024), ("o3*", 1024), ("o4*", 1024),
        ],
    ),
    (
        # DeepSeek's disk cache is on for every request and stores prefixes
        # in units of 64 tokens, so nothing shorter is cached. The figure is
        # from the announcement and the earlier context caching guide; the
        # current guide (cache prefix units since sliding window attention)
        # states no number.
        "DeepSeek: https://api-docs.deepseek.com/news/news0802, "
        "https://api-docs.deepseek.com/guides/kv_cache",
        [("deepseek-chat*", 64), ("deepseek-reasoner*", 64)],
    ),
    (
        # Gemini's implicit caching (on for 2.5 and newer) has a minimum per
        # model; the table as updated in October 2026. Gemini 3 Flash and 3
        # Pro Preview are from its May 2026 version (2.5 Flash was 1,024 and
        # 2.5 Pro 4,096 then).
        "Google: https://ai.google.dev/gemini-api/docs/caching",
        [
            ("gemini-2.5-flash", 2048), ("gemini-2.5-flash-preview*", 2048),
            ("gemini-2.5-pro", 2048), ("gemini-2.5-pro-preview*", 2048),
            ("gemini-3-flash-preview*", 1024), ("gemini-3-pro-preview*", 4096),
            ("gemini-3.1-pro*", 4096), ("gemini-3.[5-8]-flash", 4096),
            ("gemini-3.[5-8]-flash-preview*", 4096), ("gemini-4-argon*", 4096),
        ],
    ),
]

# Real names, as clients send them, and the minimum each must resolve to
# through the rows above (checked at every run).
CACHE_CHECKS = [
    ("claude-3-5-haiku-20241022", 2048), ("anthropic/claude-3-5-haiku-20241022", 2048),
    ("us.anthropic.claude-3-5-haiku-20241022-v1:0", 2048), ("anthropic/claude-3.5-haiku", 2048),
    ("claude-3-haiku-20240307", 2048), ("claude-3-7-sonnet-latest", 1024),
    ("claude-sonnet-4-20250514", 1024), ("claude-sonnet-4-5-20250929", 1024),
    ("anthropic/claude-sonnet-4.6", 1024), ("claude-opus-4-20250514", 1024),
    ("claude-opus-4-0", 1024), ("claude-opus-4-1-20250805", 1024),
    ("claude-opus-4-5-20251101", 4096), ("claude-opus-4-6", 4096),
    ("claude-opus-4-7", 2048), ("claude-opus-4-8", 1024),
    ("claude-haiku-4-5-20251001", 4096), ("databricks-claude-haiku-4-5", 4096),
    ("claude-4.5-haiku", 4096), ("claude-sonnet-5", 1024), ("claude-sonnet-5-5", 512),
    ("claude-opus-5", 512), ("anthropic/claude-opus-5.5", 512), ("claude-haiku-5-5", 512),
    ("claude-fable-5-1", 512), ("claude-mythos-preview", 2048),
    ("gpt-4o", 1024), ("gpt-4o-mini-2024-07-18", 1024), ("openai/gpt-4.1", 1024),
    ("gpt-5.1-codex", 1024), ("o3-mini", 1024), ("deepseek-chat", 64),
    ("gemini-2.5-pro", 2048), ("google/gemini-2.5-flash", 2048),
    ("gemini-3.1-pro-preview", 4096), ("gemini-3.8-flash", 4096),
    ("claude-instant-1.2", None), ("gemini-2.5-flash-lite", None), ("llama3.1:8b", None),
]

# The limit fields, in the order a row prints them.
LIMIT_FIELDS = [
    "max_image_bytes", "max_image_edge", "max_image_pixels", "max_request_bytes",
    "many_images", "many_images_edge", "image_tokens",
]

# What each provider documents of the images and requests it takes, by
# model family; each group: its sources, then (glob, fields), first match
# wins field by field. Only figures a page states are written. A size the
# page gives in MB is read as 10^6 bytes (the stricter reading) unless the
# provider's own error message gives the exact byte count; visor compares
# an image's size with its base64 length as sent. Not recorded, as no
# provider page read for this states a refusal limit for the model names
# alone: Mistral / Pixtral, Together, Fireworks, OpenRouter (it passes the
# upstream's limits on), and host-specific limits on shared model names
# (Groq's 4 MB base64 request, Bedrock's own Claude limits) — a [[model]]
# row of the user's own states those for such an upstream.
_OPENAI = {"max_image_bytes": 20_000_000, "max_request_bytes": 50_000_000}
_TILES = dict(_OPENAI, image_tokens="openai_tiles")
_PATCHES = dict(_OPENAI, image_tokens="openai_patches")
LIMITS = [
    (
        # "If you submit an image larger than 8000x8000 px, it will be
        # rejected. If you submit more than 20 images in one API request,
        # this limit is 2000x2000 px." "there is a 32MB request size limit
        # for standard endpoints" (lower on Bedrock and Vertex AI). 5 MB per
        # image (the page's FAQ); the API's refusal names the bytes: "image
        # exceeds 5 MB maximum: … bytes > 5242880 bytes"
        # (github.com/anthropics/claude-code/issues/14887), and it counts the
        # base64 length. Tokens ≈ w·h/750; an image with its long edge over
        # 1568 px or over ~1.15 megapixels is first scaled down. The page
        # allows 100 images a request (600 in its latest version):
        # `max_images` is left to the user.
        "Anthropic: https://platform.claude.com/docs/en/build-with-claude/vision, "
        "https://docs.anthropic.com/en/docs/vision",
        [
            ("*claude-*", {
                "max_image_bytes": 5_242_880, "max_image_edge": 8000,
                "max_request_bytes": 32_000_000, "many_images": 20,
                "many_images_edge": 2000, "image_tokens": "anthropic",
            }),
        ],
    ),
    (
        # "Up to 20MB per image", up to 500 images and 50 MB per request
        # (a copy of the page reads "50 MB image bytes per request"; visor
        # takes it for the whole body, the stricter reading). Tiles
        # (fit in 2048×2048, shortest side 768, tokens per 512-px tile plus
        # a base): GPT-4o, GPT-4o-mini, GPT-4.1, GPT-4.5, GPT-4 Turbo, o1,
        # o3, GPT-5; patches (32 px, at most 1536, times a multiplier):
        # gpt-4.1-mini, gpt-4.1-nano, o4-mini, gpt-5-mini, gpt-5-nano — the
        # split as the guide's "Calculating costs" gives it (and as
        # github.com/openai/openai-python/issues/2851 quotes it). Later
        # GPT-5.x models: limits only, their formula not read here.
        "OpenAI: https://developers.openai.com/api/docs/guides/images-vision, "
        "https://platform.openai.com/docs/guides/images-vision",
        [
            ("gpt-4.1-mini*", _PATCHES), ("gpt-4.1-nano*", _PATCHES),
            ("o4-mini*", _PATCHES), ("gpt-5-mini*", _PATCHES), ("gpt-5-nano*", _PATCHES),
            ("gpt-4.1", _TILES), ("gpt-4o*", _TILES), ("gpt-4.5*", _TILES),
            ("gpt-4-turbo*", _TILES), ("o1", _TILES), ("o1-pro*", _TILES),
            ("o3", _TILES), ("o3-pro*", _TILES), ("gpt-5", _TILES),
            ("gpt-5-chat*", _TILES),
            ("gpt-5*", _OPENAI),
        ],
    ),
    (
        # Inline image data: the whole request under 20 MB, prompt
        # included (larger files go through the File API; a 2026 post says
        # the inline limit was raised, its figure not read here). Tokens,
        # "with Gemini 2.0": 258 when both sides are ≤ 384 px, else 258 per
        # 768×768 tile (the tokens page); Gemini 3 counts by
        # `media_resolution` instead, so only 2.0 and 2.5 state a formula.
        "Google: https://ai.google.dev/gemini-api/docs/image-understanding, "
        "https://ai.google.dev/gemini-api/docs/tokens",
        [
            ("gemini-2.0*", {"max_request_bytes": 20_000_000, "image_tokens": "gemini"}),
            ("gemini-2.5*", {"max_request_bytes": 20_000_000, "image_tokens": "gemini"}),
            ("gemini-*", {"max_request_bytes": 20_000_000}),
        ],
    ),
    (
        # "Maximum image size: 10MiB"; "Maximum number of images: No limit".
        "xAI: https://docs.x.ai/docs/guides/image-understanding",
        [("grok-*", {"max_image_bytes": 10_485_760})],
    ),
]

_CLAUDE = {
    "max_image_bytes": 5_242_880, "max_image_edge": 8000, "max_request_bytes": 32_000_000,
    "many_images": 20, "many_images_edge": 2000, "image_tokens": "anthropic",
}
_GEMINI_2 = {"max_request_bytes": 20_000_000, "image_tokens": "gemini"}

# Real names, as clients send them, and the limit fields each must resolve
# to through the rows above (every field not listed: not stated).
LIMIT_CHECKS = [
    ("claude-sonnet-4-5", _CLAUDE), ("claude-sonnet-4-5-20250929", _CLAUDE),
    ("anthropic/claude-opus-4.6", _CLAUDE),
    ("us.anthropic.claude-3-5-sonnet-20240620-v1:0", _CLAUDE),
    ("databricks-claude-haiku-4-5", _CLAUDE),
    ("gpt-4o", _TILES), ("openai/gpt-4o-2024-08-06", _TILES), ("gpt-4o-mini", _TILES),
    ("gpt-4.1", _TILES), ("gpt-4.1-2025-04-14", _TILES), ("gpt-4.1-mini", _PATCHES),
    ("gpt-4.1-nano-2025-04-14", _PATCHES), ("o4-mini", _PATCHES), ("o3", _TILES),
    ("o1-2024-12-17", _TILES), ("gpt-5", _TILES), ("gpt-5-2025-08-07", _TILES),
    ("gpt-5-mini", _PATCHES), ("gpt-5-nano", _PATCHES), ("gpt-5.1", _OPENAI),
    ("gemini-2.5-pro", _GEMINI_2), ("google/gemini-2.0-flash", _GEMINI_2),
    ("gemini-3-pro-preview", {"max_request_bytes": 20_000_000}),
    ("grok-4", {"max_image_bytes": 10_485_760}), ("x-ai/grok-4", {"max_image_bytes": 10_485_760}),
    ("o3-mini", {}), ("llama3.1:8b", {}), ("pixtral-12b", {}), ("my-own-finetune-7b", {}),
]

# The four prices, as litellm names its per-token costs, and as visor's
# table names them (per million tokens).
PRICE_FIELDS = [
    ("input_cost_per_token", "input"),
    ("cache_read_input_token_cost", "cached_input"),
    ("cache_creation_input_token_cost", "cache_write"),
    ("output_cost_per_token", "output"),
]

# litellm providers that are the model's own publisher (its maker's API):
# where one of these prices a name, a reseller's price does not count.
PUBLISHERS = {
    "openai", "anthropic", "gemini", "vertex_ai-language-models", "deepseek",
    "mistral", "codestral", "xai", "cohere_chat", "ai21", "amazon_nova",
    "dashscope", "moonshot", "zai", "bigmodel", "minimax", "meta_llama",
    "perplexity", "xiaomi_mimo", "volcengine", "tencent",
}

# Real names, as clients send them, and the litellm entry whose prices each
# must resolve to through the finished table (checked at every run, field
# by field, the way visor merges rows).
PRICE_CHECKS = [
    ("gpt-4o", "gpt-4o"), ("openai/gpt-4o-2024-08-06", "gpt-4o-2024-08-06"),
    ("gpt-4o-mini", "gpt-4o-mini"),
    ("openrouter/openai/gpt-4o-mini", "gpt-4o-mini"),
    ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"), ("gpt-4.1", "gpt-4.1"),
    ("o3-mini-2025-01-31", "o3-mini"),
    ("claude-sonnet-4-5", "claude-sonnet-4-5"),
    ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
    ("anthropic/claude-sonnet-4.5", "vercel_ai_gateway/anthropic/claude-sonnet-4.5"),
    ("claude-haiku-4-5-20251001", "claude-haiku-4-5"),
    ("claude-3-5-haiku-20241022", "anthropic.claude-3-5-haiku-20241022-v1:0"),
    ("us.anthropic.claude-3-5-haiku-20241022-v1:0", "anthropic.claude-3-5-haiku-20241022-v1:0"),
    ("deepseek-chat", "deepseek-chat"), ("deepseek/deepseek-chat", "deepseek-chat"),
    ("gemini-2.5-flash", "gemini/gemini-2.5-flash"),
    ("google/gemini-2.5-flash", "gemini/gemini-2.5-flash"),
    ("gemini-2.5-pro", "gemini/gemini-2.5-pro"),
]


def extract_prices(path):
    """scripts/data/model-prices.tsv from litellm's bundled model map: one
    line per chat or responses entry that states at least one of the four
    costs, the costs per token exactly as the map writes them."""
    with open(path) as f:
        data = json.load(f)
    print("# Model prices as published in the litellm package (version in README.md beside this file),")
    print("# per token, as the model map writes them. Empty cell = not stated by the source.")
    print("\t".join(["model", "provider", "mode"] + [f for f, _ in PRICE_FIELDS]))
    n = 0
    for key in sorted(data):
        e = data[key]
        if not isinstance(e, dict) or e.get("mode") not in ("chat", "responses"):
            continue
        costs = [e.get(f) for f, _ in PRICE_FIELDS]
        if all(c is None for c in costs):
            continue
        if any(c is not None and not isinstance(c, (int, float)) for c in costs):
            print(f"skipped {key}: a cost is not a number: {costs}", file=sys.stderr)
            continue
        cells = ["" if c is None else repr(c) for c in costs]
        print("\t".join([key, e.get("litellm_provider", ""), e["mode"]] + cells))
        n += 1
    print(f"{n} entries", file=sys.stderr)


def per_million(cell):
    """A per-token cost cell as a price per million tokens, to six
    significant digits (the map carries float noise: 2.9999900000000002e-06),
    written plain (`2.5`, `0.075`, `10`)."""
    if cell == "":
        return None
    d = Decimal(cell) * 1_000_000
    if d < 0:
        sys.exit(f"negative price in the data: {cell}")
    if d == 0:
        return "0"
    d = d.quantize(Decimal(1).scaleb(d.adjusted() - 5))
    return format(d.normalize(), "f")


def load_prices(path):
    """(key, provider, prices) per entry; prices a tuple of four
    per-million strings or None, in PRICE_FIELDS order."""
    with open(path) as f:
        rows = [r for r in csv.reader(f, delimiter="\t") if r and not r[0].startswith("#")]
    return [(r[0], r[1], tuple(per_million(c) for c in r[3:7])) for r in rows[1:]]


def price_rows(entries):
    """The price rows: one per normalised name, exact, and one per dated
    name of a publisher's whose price differs from its name's.

    Several litellm entries normalise to one name (dated versions, every
    host's listing, regional endpoints), often at different prices. One
    entry's four prices are taken whole, never mixed; deterministically:

    1. An entry whose prices are all 0 (a free tier, a subscription, a local
       runtime) counts only where no other entry prices the name: it says
       nothing of what the model costs elsewhere. A name only such entries
       price gets no row (visor then shows tokens, not money).
    2. The best-ranked entries decide: first litellm's own key equal to the
       name (`gpt-4o`, `claude-sonnet-4-5`, `deepseek-chat`), then a
       publisher's API (PUBLISHERS: `gemini/gemini-2.5-flash`), then any
       key without a provider path (Bedrock's model ids:
       `anthropic.claude-3-5-haiku-20241022-v1:0`), then every other host.
    3. Among those, the prices most of them carry; on a tie, those stating
       the most of the four fields, then those of the alphabetically first
       key.

    A name is normalised until it no longer changes (`in.moonshotai.kimi-k3`
    is `kimi-k3`, not `moonshotai.kimi-k3`): a row for a name that visor
    would normalise further is one no request reaches.

    A dated name a publisher prices differently from its name
    (`gpt-4o-2024-05-13`) gets an exact row of its own, placed before the
    names: visor matches the name as sent before its normalised form. It
    states what its entry states; as with every row, a field it leaves out
    comes from the next matching row, its name's (`gpt-4o-2024-05-13` has no
    cache price and takes gpt-4o's, which a model that caches nothing never
    uses).

    OpenAI's fine-tuned models (`ft:…`) get no row: visor's normalisation
    drops everything after the first `:`, so all of them would share one.
    """
    def rank(key, provider, name):
        k = key.lower()
        if k == name:
            return 0
        if provider in PUBLISHERS:
            return 1
        if "/" not in k:
            return 2
        return 3

    def choose(group):
        """group: [(rank, key, prices)] -> prices, by rules 2 and 3."""
        best = min(r for r, _, _ in group)
        top = sorted((k, p) for r, k, p in group if r == best)
        counts = Counter(p for _, p in top)
        stated = lambda p: sum(v is not None for v in p)
        return min(top, key=lambda kp: (-counts[kp[1]], -stated(kp[1]), kp[0]))[1]

    def fixpoint(name):
        while normalise(name) != name:
            name = normalise(name)
        return name

    free = lambda p: all(v in (None, "0") for v in p)
    by_name = defaultdict(list)
    for key, provider, prices in entries:
        if all(v is None for v in prices):
            continue
        # A fine-tuned model (`ft:gpt-4o-2024-08-06:org::id`) normalises to
        # `ft` whatever its base: no row could price one apart from another.
        if key.lower().startswith("ft:"):
            continue
        # A row is an exact name; one holding a glob's metacharacters
        # (none does today) would match more than itself.
        if any(c in normalise(key) for c in "*?[]{}\\"):
            print("no price row for a name with glob characters:", key, file=sys.stderr)
            continue
        by_name[fixpoint(normalise(key))].append((key, provider, prices))

    names, dated, inherits = {}, {}, []
    for name, es in by_name.items():
        paid = [e for e in es if not free(e[2])]
        if not paid:
            continue
        chosen = choose([(rank(k, pv, name), k, p) for k, pv, p in paid])
        names[name] = chosen
        # Dated names as the publisher lists them (its own API only).
        forms = defaultdict(list)
        for k, pv, p in paid:
            r = rank(k, pv, name)
            if r > 1:
                continue
            form = VENDOR.sub("", REGION.sub("", k.lower().rsplit("/", 1)[-1]))
            if form != name:
                forms[form].append((r, k, p))
        for form, group in forms.items():
            p = choose(group)
            if p == chosen:
                continue
            dated[form] = p
            if any(c is None and n is not None for c, n in zip(p, chosen)):
                inherits.append((form, p, name, chosen))

    def row(match, p):
        out = {"match": match}
        for (_, field), v in zip(PRICE_FIELDS, p):
            if v is not None:
                out[field] = v
        return out

    rows = [row(n, dated[n]) for n in sorted(dated)] + [row(n, names[n]) for n in sorted(names)]
    return rows, inherits


def prices_of(name, rows):
    """The four prices `name` resolves to through `rows`, field by field
    (each from the first row matching any of the name's forms)."""
    forms = candidates(name)
    out = [None] * len(PRICE_FIELDS)
    for r in rows:
        if any(glob_match(r["match"], f) for f in forms):
            for i, (_, field) in enumerate(PRICE_FIELDS):
                if out[i] is None and field in r:
                    out[i] = r[field]
    return tuple(out)


def marker(name):
    """The vision marker in a name, as `vision_marker` in src/models.rs."""
    n = name.lower().rsplit("/", 1)[-1]
    for m in re.finditer(r"[a-z]+", n):
        run, start, end = m.group(), m.start(), m.end()
        if run in ("vl", "vlm", "vision", "omni", "internvl", "qvq"):
            return run
        if run == "v" and start > 0 and n[start - 1].isdigit() and not n[end:end + 1].isdigit():
            return run
        if run.endswith("llava") or run.endswith("vlm"):
            return run
    return None


def normalise(name):
    n = name.lower().rsplit("/", 1)[-1]
    n = REGION.sub("", n)
    n = VENDOR.sub("", n)
    changed = True
    while changed:
        changed = False
        for s in SUFFIXES:
            m = s.sub("", n)
            if m != n and m:
                n, changed = m, True
    return n


def merge(values):
    """One stated value for a name from several hosts: agreement, else the
    majority, else not stated."""
    stated = [v for v in values if v is not None]
    if not stated:
        return None
    t, f = stated.count(True), stated.count(False)
    return True if t > f else False if f > t else None


def flag(cell):
    return {"true": True, "false": False}.get(cell.strip().lower())


def glob_match(pattern, name):
    """`*` matches anything (across `/` too) and `[...]` one of a class, as
    the table's globs (globset, `literal_separator(false)`)."""
    return fnmatch.fnmatchcase(name, pattern)


def candidates(name):
    """The forms visor matches a requested name in (`candidates` in
    src/models.rs): as sent, without its provider path, without a dotted
    region/vendor prefix, without version/date/tag suffixes."""
    lower = name.strip().lower()
    base = lower.rsplit("/", 1)[-1]
    unprefixed = VENDOR.sub("", REGION.sub("", base))
    out = []
    for f in (lower, base, unprefixed, normalise(unprefixed)):
        if f and f not in out:
            out.append(f)
    return out


def cache_min_tokens(name, rows):
    """What the cache rows give `name`: the first row matching any form."""
    forms = candidates(name)
    for r in rows:
        if any(glob_match(r["match"], f) for f in forms):
            return r["cache_min_tokens"]
    return None


def limits_of(name, rows):
    """The limit fields `name` resolves to through `rows`, field by field
    (each from the first row matching any of the name's forms)."""
    forms = candidates(name)
    out = {}
    for r in rows:
        if any(glob_match(r["match"], f) for f in forms):
            for k in LIMIT_FIELDS:
                if k in r and k not in out:
                    out[k] = r[k]
    return out


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--extract-prices":
        extract_prices(sys.argv[2])
        return
    path = sys.argv[1] if len(sys.argv) > 1 else "scripts/data/model-capabilities.tsv"
    prices_path = sys.argv[2] if len(sys.argv) > 2 else "scripts/data/model-prices.tsv"
    by_name = defaultdict(lambda: {"vision": [], "audio": [], "pdf": [], "ctx": []})
    with open(path) as f:
        rows = [r for r in csv.reader(f, delimiter="\t") if r and not r[0].startswith("#")]
    for r in rows[1:]:
        e = by_name[normalise(r[0])]
        e["vision"].append(flag(r[2]))
        e["audio"].append(flag(r[3]))
        e["pdf"].append(flag(r[4]))
        if r[5].strip():
            e["ctx"].append(int(r[5]))
    names = {}
    for n, e in by_name.items():
        ctx = max(set(e["ctx"]), key=e["ctx"].count) if e["ctx"] else None
        names[n] = {"vision": merge(e["vision"]), "audio": merge(e["audio"]),
                    "pdf": merge(e["pdf"]), "ctx": ctx}
    stated = {n: v for n, v in names.items() if v["vision"] is not None}

    def manual_row(n):
        return next(((p, v) for p, v in MANUAL if glob_match(p, n)), None)

    # Hand rows come first; a stated name a hand row gets wrong becomes an
    # exact row above them. Families are folded from the names no hand row
    # covers, so a data glob never overrides a hand row.
    def documented_row(n):
        return next(((p, v) for p, v in DOCUMENTED if glob_match(p, n)), None)

    exceptions = []
    rest = {}
    overridden = []
    for n, v in stated.items():
        if marker(n):
            if not v["vision"]:
                overridden.append((n, v["vision"], "marker " + marker(n)))
            continue
        d = documented_row(n)
        if d is not None:
            if d[1] != v["vision"]:
                overridden.append((n, v["vision"], d[0]))
            continue
        m = manual_row(n)
        if m is None:
            rest[n] = v
        elif m[1] != v["vision"]:
            exceptions.append(n)

    def agrees(p):
        vals = {v["vision"] for n, v in rest.items() if n.startswith(p)}
        count = sum(1 for n in rest if n.startswith(p))
        return len(vals) == 1 and count >= 2

    chosen = {}
    for n in sorted(rest):
        best = None
        for i, c in enumerate(n):
            if c in SEPS and i >= 3 and agrees(n[:i]):
                best = n[:i]
                break
        chosen.setdefault(best + "*" if best else n, []).append(n)

    def row(pattern, members):
        vals = [names[m] for m in members]
        out = {"match": pattern}
        v = {x["vision"] for x in vals} - {None}
        if len(v) == 1:
            out["vision"] = v.pop()
        for key in ("audio", "pdf"):
            s = {x[key] for x in vals} - {None}
            if len(s) == 1:
                out[key] = s.pop()
        c = {x["ctx"] for x in vals}
        if len(c) == 1 and None not in c:
            out["context_window"] = c.pop()
        return out

    def members_of(pattern):
        if pattern.endswith("*"):
            p = pattern[:-1]
            return [n for n in names if n.startswith(p) and manual_row(n) is None
                    and documented_row(n) is None and not marker(n)]
        return [pattern]

    data_rows = [row(p, members_of(p)) for p in chosen]
    # Exact names first, then globs from the most specific down.
    data_rows.sort(key=lambda r: (r["match"].endswith("*"), -len(r["match"]), r["match"]))
    table = (
        [{"match": p, "vision": v} for p, v in DOCUMENTED]
        + sorted((row(n, [n]) for n in exceptions), key=lambda r: r["match"])
        + [{"match": p, "vision": v} for p, v in MANUAL]
        + data_rows
    )

    cache_rows = [{"match": p, "cache_min_tokens": n, "source": src if i == 0 else None}
                  for src, group in CACHE_MIN_TOKENS for i, (p, n) in enumerate(group)]
    wrong = [(n, cache_min_tokens(n, cache_rows), want) for n, want in CACHE_CHECKS
             if cache_min_tokens(n, cache_rows) != want]
    if wrong:
        for w in wrong:
            print("cache_min_tokens (name, got, documented):", w, file=sys.stderr)
        sys.exit(1)

    limit_rows = [dict(fields, match=p, limits_source=src if i == 0 else None)
                  for src, group in LIMITS for i, (p, fields) in enumerate(group)]
    wrong = [(n, limits_of(n, limit_rows), want) for n, want in LIMIT_CHECKS
             if limits_of(n, limit_rows) != want]
    if wrong:
        for w in wrong:
            print("limits (name, got, documented):", w, file=sys.stderr)
        sys.exit(1)

    entries = load_prices(prices_path)
    prices, inherits = price_rows(entries)
    for k in inherits:
        print("dated row takes a field it does not state from its name's row:", k, file=sys.stderr)
    by_key = {k: p for k, _, p in entries}
    wrong = [(n, prices_of(n, prices), by_key.get(k)) for n, k in PRICE_CHECKS
             if prices_of(n, prices) != by_key.get(k)]
    # Every name and dated name resolves to the prices chosen for it (a
    # dated one: to those it states).
    for r in prices:
        got = prices_of(r["match"], prices)
        want = tuple(r.get(f) for _, f in PRICE_FIELDS)
        if any(w is not None and g != w for g, w in zip(got, want)) or (
                normalise(r["match"]) == r["match"] and got != want):
            wrong.append((r["match"], got, want))
    if wrong:
        for w in wrong:
            print("price (name, got, want):", w, file=sys.stderr)
        sys.exit(1)
    if prices:
        prices[0]["source"] = "prices"

    for o in overridden:
        print("documented fact over the data:", o, file=sys.stderr)
    bad = []
    overridden_names = {o[0] for o in overridden}
    for n, v in stated.items():
        if n in overridden_names:
            continue
        if marker(n):
            continue
        for r in table:
            if "vision" in r and glob_match(r["match"], n):
                if r.get("vision") != v["vision"]:
                    bad.append((n, v["vision"], r["match"]))
                break
        else:
            bad.append((n, v["vision"], None))
    if bad:
        for b in bad:
            print("mismatch:", b, file=sys.stderr)
        sys.exit(1)

    print("# The built-in model-spec table, compiled into visor. Generated by")
    print("# scripts/gen_models.py from litellm's public model map (see")
    print("# scripts/data/README.md) plus hand rows for text-only families the")
    print("# source leaves blank, and rows for facts documented by the publishers")
    print("# above both. First match wins; user [[model]] rows come first, then a")
    print("# vision marker in the name (vl, vision, omni, llava, 4.5v...), then these.")
    print("# Names are matched lower case, with and without provider prefix and")
    print("# date/version suffix. A missing field means \"not stated\".")
    print(f"# {len(stated)} names with a stated vision flag -> {len(table)} rows;")
    print(f"# then {len(cache_rows)} rows with the providers' documented cache_min_tokens")
    print("# (the shortest prefix they cache; 1024 where no row says);")
    print(f"# then {len(limit_rows)} rows with the providers' documented image and request")
    print("# limits and image token formula (max_image_bytes ... image_tokens);")
    print(f"# then {len(prices)} rows with prices in US dollars per million tokens from")
    print("# litellm's map too (input, cached_input, cache_write, output; exact names,")
    print("# dated ones first; the release is named in scripts/data/README.md).")
    for r in table + cache_rows + limit_rows + prices:
        if r.get("limits_source"):
            print()
            print(f"# image and request limits, {r['limits_source']}")
        elif r.get("source") == "prices":
            print()
            print("# Prices per million tokens, litellm's model map (scripts/data/model-prices.tsv);")
            print("# one entry's prices per name, chosen as scripts/gen_models.py says.")
        elif r.get("source"):
            print()
            print(f"# cache_min_tokens, {r['source']}")
        print()
        print("[[model]]")
        for k in ("match", "vision", "audio", "pdf", "context_window", "cache_min_tokens",
                  *LIMIT_FIELDS):
            if k in r:
                v = r[k]
                print(f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower()))
        for _, k in PRICE_FIELDS:
            if k in r:
                print(f"{k} = {r[k]}")


main()
