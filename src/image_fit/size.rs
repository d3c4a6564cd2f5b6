//! The size an image is sent at: within the provider's limits (edge,
//! pixels, the lower edge bound of a request with many images), at most
//! the size the provider would scale it to anyway, and, opt-in, within a
//! long-edge or token budget by the provider's own token formula. Pure
//! arithmetic: no image is decoded here.

/// How a provider counts an image's tokens, and how it scales an image
/// before it reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Formula {
    /// Anthropic: about w·h/750 tokens; an image whose long edge is over
    /// 1568 px or that is over ~1,600 tokens is scaled down first.
    Anthropic,
    /// OpenAI (GPT-4o, GPT-4.1, o1, o3 at `detail: high`): fitted in
    /// 2048×2048, then its shortest side to 768; 85 tokens + 170 per
    /// 512-px tile.
    OpenaiTiles,
    /// OpenAI (gpt-4.1-mini, gpt-4.1-nano, o4-mini…): 32-px patches, at
    /// most 1536 (scaled down to fit); a token a patch before the model's
    /// own multiplier.
    OpenaiPatches,
    /// Gemini: 258 tokens when both sides are at most 384 px, else 258 per
    /// 768-px tile. Gemini does not scale an image down itself.
    Gemini,
}

/// Anthropic's long-edge and token bounds above which it scales down.
const ANTHROPIC_EDGE: u32 = 1568;
const ANTHROPIC_TOKENS: u64 = 1600;
const ANTHROPIC_PIXELS_PER_TOKEN: u64 = 750;
/// OpenAI's tile scaling.
const OPENAI_FIT: u32 = 2048;
const OPENAI_SHORT: u32 = 768;
const OPENAI_TILE: u32 = 512;
/// OpenAI's patches.
const PATCH: u32 = 32;
const MAX_PATCHES: u64 = 1536;
/// Gemini's tiles.
const GEMINI_SMALL: u32 = 384;
const GEMINI_TILE: u32 = 768;
const GEMINI_TILE_TOKENS: u64 = 258;

impl Formula {
    /// The size the provider reads an image of `w`×`h` at.
    pub fn provider_size(self, w: u32, h: u32) -> (u32, u32) {
        match self {
            Formula::Anthropic => {
                let pixels = ANTHROPIC_TOKENS * ANTHROPIC_PIXELS_PER_TOKEN;
                within(w, h, ANTHROPIC_EDGE, pixels)
            }
            Formula::OpenaiTiles => {
                let (w, h) = within(w, h, OPENAI_FIT, u64::MAX);
                let short = w.min(h);
                match short > OPENAI_SHORT {
                    true => scaled(w, h, f64::from(OPENAI_SHORT) / f64::from(short)),
                    false => (w, h),
                }
            }
            Formula::OpenaiPatches => {
                if patches(w, h) <= MAX_PATCHES {
                    return (w, h);
                }
                let p = f64::from(PATCH);
                let s = (p * p * MAX_PATCHES as f64 / (f64::from(w) * f64::from(h))).sqrt();
                // As OpenAI says it: then down to whole patches on the
                // side that needs it most.
                let (sw, sh) = (f64::from(w) * s / p, f64::from(h) * s / p);
                let s = s * (sw.floor() / sw).min(sh.floor() / sh);
                let (mut w, mut h) = scaled(w, h, s);
                while patches(w, h) > MAX_PATCHES && w.max(h) > 1 {
                    (w, h) = scaled(w, h, 0.99);
                }
                (w, h)
            }
            Formula::Gemini => (w, h),
        }
    }

    /// The tokens the provider bills an image of `w`×`h` (read at its
    /// [`Formula::provider_size`]).
    pub fn tokens(self, w: u32, h: u32) -> u64 {
        let (w, h) = self.provider_size(w, h);
        match self {
            Formula::Anthropic => {
                (u64::from(w) * u64::from(h)).div_ceil(ANTHROPIC_PIXELS_PER_TOKEN)
            }
            Formula::OpenaiTiles => {
                let tiles = u64::from(w.div_ceil(OPENAI_TILE)) * u64::from(h.div_ceil(OPENAI_TILE));
                85 + 170 * tiles
            }
            Formula::OpenaiPatches => patches(w, h),
            Formula::Gemini if w <= GEMINI_SMALL && h <= GEMINI_SMALL => GEMINI_TILE_TOKENS,
            Formula::Gemini => {
                let tiles = u64::from(w.div_ceil(GEMINI_TILE)) * u64::from(h.div_ceil(GEMINI_TILE));
                GEMINI_TILE_TOKENS * tiles
            }
        }
    }
}

fn patches(w: u32, h: u32) -> u64 {
    u64::from(w.div_ceil(PATCH)) * u64::from(h.div_ceil(PATCH))
}

/// What an image sent to one model must fit, and how far visor scales it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Limits {
    /// The largest image, compared with its base64 length as sent.
    pub max_bytes: Option<u64>,
    pub max_edge: Option<u32>,
    pub max_pixels: Option<u64>,
    /// Past this many images in a request the edge bound is `many_edge`.
    pub many_images: Option<u32>,
    pub many_edge: Option<u32>,
    /// The largest request body.
    pub max_request_bytes: Option<u64>,
    /// The provider's token formula, when the table states it.
    pub formula: Option<Formula>,
    /// Scale an image down to the size the provider would scale it to
    /// anyway (`images.provider_size`, on by default).
    pub provider_size: bool,
    /// Opt-in diet: the longest edge (`images.max_edge`).
    pub diet_edge: Option<u32>,
    /// Opt-in diet: the most tokens an image may cost by `formula`
    /// (`images.max_image_tokens`).
    pub diet_tokens: Option<u32>,
    /// Base64 of an image found in a text is sent as an image part (or
    /// replaced where the API takes none): never as text.
    pub hoist_text: bool,
}

impl Limits {
    /// No limit: nothing is fitted.
    pub const NONE: Limits = Limits {
        max_bytes: None,
        max_edge: None,
        max_pixels: None,
        many_images: None,
        many_edge: None,
        max_request_bytes: None,
        formula: None,
        provider_size: false,
        diet_edge: None,
        diet_tokens: None,
        hoist_text: false,
    };

    /// True when nothing would ever be scaled or re-encoded.
    pub fn is_none(&self) -> bool {
        let scales = self.provider_size && self.formula.is_some_and(|f| f != Formula::Gemini);
        !scales
            && self.max_bytes.is_none()
            && self.max_edge.is_none()
            && self.max_pixels.is_none()
            && self.many_edge.is_none()
            && self.max_request_bytes.is_none()
            && self.diet_edge.is_none()
            && (self.diet_tokens.is_none() || self.formula.is_none())
    }

    /// The edge bound for a request of `images` images.
    fn edge(&self, images: usize) -> u32 {
        let many = match (self.many_images, self.many_edge) {
            (Some(n), Some(e)) if images > n as usize => e,
            _ => u32::MAX,
        };
        [self.max_edge, self.diet_edge]
            .into_iter()
            .flatten()
            .fold(many, u32::min)
    }

    /// The size an image of `w`×`h` is to be sent at, in a request of
    /// `images` images; `None` when it is sent as it is (by size: its
    /// bytes are judged apart).
    pub fn target(&self, w: u32, h: u32, images: usize) -> Option<(u32, u32)> {
        if w == 0 || h == 0 {
            return None;
        }
        let (mut tw, mut th) = within(w, h, self.edge(images), self.max_pixels.unwrap_or(u64::MAX));
        if let Some(f) = self.formula {
            if self.provider_size {
                (tw, th) = f.provider_size(tw, th);
            }
            if let Some(budget) = self.diet_tokens {
                (tw, th) = under_tokens(f, tw, th, u64::from(budget));
            }
        }
        (tw < w || th < h).then_some((tw, th))
    }
}

/// The largest scale of `w`×`h` whose tokens by `f` are within `budget`
/// (found by bisection: tokens only grow with the scale).
fn under_tokens(f: Formula, w: u32, h: u32, budget: u64) -> (u32, u32) {
    // Within it already, or under what any image costs (a tile's price):
    // not shrunk to nothing for a budget no size meets.
    if f.tokens(w, h) <= budget || f.tokens(1, 1) > budget {
        return (w, h);
    }
    let (mut lo, mut hi) = (0.0_f64, 1.0_f64);
    for _ in 0..32 {
        let mid = (lo + hi) / 2.0;
        let (sw, sh) = scaled(w, h, mid);
        match f.tokens(sw, sh) <= budget {
            true => lo = mid,
            false => hi = mid,
        }
    }
    scaled(w, h, lo)
}

/// `w`×`h` scaled down, aspect kept, to a long edge of at most `edge` and
/// at most `pixels` pixels (itself when it is within both).
pub fn within(w: u32, h: u32, edge: u32, pixels: u64) -> (u32, u32) {
    let long = w.max(h);
    let area = u64::from(w) * u64::from(h);
    if long <= edge && area <= pixels {
        return (w, h);
    }
    let by_edge = f64::from(edge) / f64::from(long);
    let by_area = (pixels as f64 / area as f64).sqrt();
    let (mut tw, mut th) = scaled(w, h, by_edge.min(by_area).min(1.0));
    // Rounding never takes it over either bound.
    while (tw.max(th) > edge || u64::from(tw) * u64::from(th) > pixels) && tw.max(th) > 1 {
        (tw, th) = scaled(tw, th, 0.999);
    }
    (tw, th)
}

/// `w`×`h` times `s` (≤ 1), rounded down, at least 1×1.
fn scaled(w: u32, h: u32, s: f64) -> (u32, u32) {
    let one = |v: u32| ((f64::from(v) * s).floor() as u32).clamp(1, v);
    (one(w), one(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anthropic() -> Limits {
        Limits {
            max_bytes: Some(5 * 1024 * 1024),
            max_edge: Some(8000),
            many_images: Some(20),
            many_edge: Some(2000),
            formula: Some(Formula::Anthropic),
            ..Limits::default()
        }
    }

    #[test]
    fn an_image_over_the_edge_bound_is_scaled_with_its_aspect() {
        let l = anthropic();
        let (w, h) = l.target(9000, 6000, 1).unwrap();
        assert!(w <= 8000 && h <= 8000);
        assert_eq!((w, h), (8000, 5333));
        // Within the bound: as it is.
        assert_eq!(l.target(2880, 1800, 1), None);
    }

    #[test]
    fn many_images_lower_the_edge_bound() {
        let l = anthropic();
        assert_eq!(l.target(2880, 1800, 20), None);
        assert_eq!(l.target(2880, 1800, 21), Some((2000, 1250)));
    }

    #[test]
    fn the_provider_size_is_where_the_provider_would_scale_anyway() {
        let l = Limits {
            provider_size: true,
            ..anthropic()
        };
        let (w, h) = l.target(2880, 1800, 1).unwrap();
        assert!(
            w <= 1568 && u64::from(w) * u64::from(h) <= 1_200_000,
            "{w}x{h}"
        );
        // Scaled once, it is not scaled again.
        assert_eq!(l.target(w, h, 1), None);
        // An image the provider reads as it is stays.
        assert_eq!(l.target(1000, 800, 1), None);
    }

    #[test]
    fn openai_tiles_fit_2048_then_768_on_the_short_side() {
        let f = Formula::OpenaiTiles;
        assert_eq!(f.provider_size(4096, 2048), (1536, 768));
        assert_eq!(f.provider_size(1024, 1024), (768, 768));
        assert_eq!(f.provider_size(500, 300), (500, 300));
        // OpenAI's worked examples: 1024×1024 → 765 tokens, 2048×4096 →
        // 1105.
        assert_eq!(f.tokens(1024, 1024), 765);
        assert_eq!(f.tokens(2048, 4096), 1105);
    }

    #[test]
    fn openai_patches_are_capped_at_1536() {
        let f = Formula::OpenaiPatches;
        // OpenAI's examples: 1024×1024 → 1024 patches; 1800×2400 → 1452.
        assert_eq!(f.tokens(1024, 1024), 1024);
        let (w, h) = f.provider_size(1800, 2400);
        assert!(patches(w, h) <= 1536);
        assert_eq!(f.tokens(1800, 2400), 1452);
    }

    #[test]
    fn gemini_counts_tiles_and_does_not_scale() {
        let f = Formula::Gemini;
        assert_eq!(f.tokens(384, 384), 258);
        assert_eq!(f.tokens(1000, 700), 258 * 2);
        assert_eq!(f.provider_size(3000, 3000), (3000, 3000));
    }

    #[test]
    fn a_token_diet_scales_until_the_formula_is_within_it() {
        let l = Limits {
            diet_tokens: Some(800),
            ..anthropic()
        };
        let (w, h) = l.target(1500, 1000, 1).unwrap();
        assert!(Formula::Anthropic.tokens(w, h) <= 800);
        // Not much further than it needs: a tenth larger would not fit.
        assert!(Formula::Anthropic.tokens(w * 11 / 10, h * 11 / 10) > 800);
        let l = Limits {
            diet_edge: Some(1024),
            ..Limits::default()
        };
        assert_eq!(l.target(2048, 1024, 1), Some((1024, 512)));
    }

    #[test]
    fn within_never_rounds_over_a_bound() {
        for (w, h) in [(9999, 7), (7, 9999), (12345, 6789), (1, 1), (3, 100_000)] {
            for (edge, pixels) in [(8000, u64::MAX), (2000, 1_000_000), (1, 1), (50, 49)] {
                let (tw, th) = within(w, h, edge, pixels);
                assert!(tw >= 1 && th >= 1);
                assert!(tw <= w && th <= h);
                assert!(tw.max(th) <= edge.max(1), "{w}x{h} → {tw}x{th} over {edge}");
                assert!(u64::from(tw) * u64::from(th) <= pixels.max(1));
            }
        }
    }
}
