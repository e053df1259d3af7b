#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate_fuzz::redis_frame::check(data));
