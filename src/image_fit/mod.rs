//! Images that fit the model that sees them: the size each is sent at
//! ([`size`]: the provider's limits, the size it would scale to anyway,
//! an opt-in token diet) and the scaling itself ([`codec`]: decoded within
//! bounds, scaled, encoded again). Both pure; the proxy caches the results
//! and runs them off its threads.

pub mod codec;
pub mod size;

pub use codec::{Fitted, Unfit, base64_len, fit};
pub use size::{Formula, Limits};
