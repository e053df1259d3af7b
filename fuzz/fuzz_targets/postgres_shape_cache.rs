#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate_fuzz::postgres_shape_cache::check(data));
