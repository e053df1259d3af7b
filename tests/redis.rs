//! The Redis gateway inside a real node in front of a real redis-server: one test binary, one
//! module per concern (the filter's own tests are in filters/redis/tests).

mod support;

mod redis {
    mod audit;
    mod fencing;
    mod flood;
    mod health;
    mod module;
    mod protocol;
    mod tls;
}
