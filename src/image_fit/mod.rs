//! Images that fit the model that sees them: the size each is sent at
//! ([`size`]: the provider's limits, the size it would scale to anyway,
//! an opt-in token diet) and the scaling itself (the `visor-image-fit`
//! crate: decoded within bounds, scaled, encoded again). Both pure; the
//! proxy caches the results and runs them off its threads.

pub mod size;
#[cfg(test)]
pub(crate) mod test_images;

pub use size::{Formula, Limits};
pub use visor_image_fit::{DECODE_MAX_PIXELS, Fitted, Unfit, base64_len, fit};
