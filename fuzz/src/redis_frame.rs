//! RESP frames (`fencegate_redis::frame`): any bytes give a frame, "incomplete" or an error,
//! never a panic; a parsed frame re-encodes to bytes that parse back to the same frame in
//! exactly their length (the gateway re-encodes upstream replies); every proper prefix of a
//! frame is "incomplete" (a frame split across reads is not refused); requests round-trip;
//! `frame_len` reads the length `parse` consumes, with the same errors.

use fencegate_redis::frame::{frame_len, parse, parse_request, Frame, Limits};

/// The limits the first input byte selects: the default, and small ones that reach the
/// size and depth checks with short inputs.
fn limits(selector: u8) -> Limits {
    match selector % 4 {
        0 => Limits::default(),
        1 => Limits {
            max_frame_bytes: 1024,
            max_depth: 4,
        },
        2 => Limits {
            max_frame_bytes: 64,
            max_depth: 2,
        },
        _ => Limits {
            max_frame_bytes: 1 << 20,
            max_depth: 64,
        },
    }
}

/// The fuzz target's body.
pub fn check(data: &[u8]) {
    let Some((&selector, buf)) = data.split_first() else {
        return;
    };
    let limits = limits(selector);
    // The reply reader takes a frame's length first, then reads it from its own bytes.
    assert_eq!(
        frame_len(buf, &limits),
        parse(buf, &limits).map(|f| f.map(|(_, len)| len)),
        "frame_len and parse disagree"
    );
    if let Ok(Some((frame, used))) = parse(buf, &limits) {
        assert!(
            used > 0 && used <= buf.len(),
            "consumed {used} of {}",
            buf.len()
        );
        round_trip(&frame, &limits);
        for cut in [0, used / 2, used - 1] {
            match parse(&buf[..cut], &limits) {
                Ok(None) => {}
                Err(fencegate_redis::FrameError::TooLarge { .. })
                    if cut > limits.max_frame_bytes => {}
                other => panic!("a {cut}-byte prefix of a {used}-byte frame gave {other:?}"),
            }
        }
    }
    if let Ok(Some(request)) = parse_request(buf, &limits) {
        assert!(request.wire_len <= buf.len());
        if buf.first() == Some(&b'*') {
            let again = Frame::command(request.args.clone()).to_bytes();
            let parsed = parse_request(&again, &Limits::default())
                .expect("a re-encoded request parses")
                .expect("a re-encoded request is complete");
            assert_eq!(parsed.args, request.args);
            assert_eq!(parsed.wire_len, again.len());
        }
    }
}

fn round_trip(frame: &Frame, limits: &Limits) {
    let encoded = frame.to_bytes();
    let relaxed = Limits {
        max_frame_bytes: Limits::default().max_frame_bytes,
        max_depth: limits.max_depth,
    };
    match parse(&encoded, &relaxed) {
        Ok(Some((again, used))) => {
            assert_eq!(&again, frame, "re-encoded as {encoded:?}");
            assert_eq!(used, encoded.len(), "re-encoded as {encoded:?}");
        }
        other => panic!("{frame:?} re-encoded as {encoded:?} parses as {other:?}"),
    }
}
