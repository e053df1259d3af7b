#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate_fuzz::token_parse::check(data));
