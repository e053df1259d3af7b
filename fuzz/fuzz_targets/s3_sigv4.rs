#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate_fuzz::s3_sigv4::check(data));
