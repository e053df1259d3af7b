//! The S3 gateway inside a real node in front of moto: one test binary, one module per concern
//! (the filter's own tests are in filters/s3/tests).

mod support;

mod s3 {
    mod maintenance;
    mod node;
    mod upload_restart;
}
