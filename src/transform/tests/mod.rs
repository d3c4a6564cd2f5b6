//! The transform's tests, one file per stage they exercise (through
//! `rewrite`, as a caller meets them): `images.rs` (the walk, images in
//! text, decoding, placeholders and the splice, in every API shape),
//! `rules.rs` (the image rules), `dedup.rs` (context dedup); `support.rs`
//! is what they share. Unit tests of a single function sit in its stage's
//! file (`placeholder.rs`, `json.rs`, `dedup.rs`, `coalesce.rs`).

mod continued;
mod dedup;
mod fit;
mod images;
mod media;
mod rules;
mod support;
