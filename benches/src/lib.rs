//! Criterion benches for epcomm transports; see `benches/`.
