//! PostgreSQL wire messages (`fencegate_postgres::message`): the startup parser and the typed
//! frame parser give the same messages whether the bytes arrive at once or in pieces, never
//! panic, and every frame is exactly its declared length; the body readers (Query, Parse,
//! Bind, Close/Describe, ErrorResponse, ParameterStatus) take any body; and `FrameReader`, the
//! async reader the sessions use, yields the same frames as the parser over a whole buffer.

use std::sync::OnceLock;

use bytes::BytesMut;
use fencegate_postgres::lexing::Lexing;
use fencegate_postgres::message::{
    bind_fields, error_code_and_detail, parse_fields, parse_frame, parse_startup, query_text,
    target_fields, Frame, FrameError, FrameReader, Startup,
};

/// What parsing a whole stream gives: the startup packet (if the stream starts with one), the
/// frames after it, and how it ended.
#[derive(Debug, PartialEq)]
struct Outcome {
    startup: Option<Startup>,
    frames: Vec<Frame>,
    error: Option<FrameError>,
}

/// The fuzz target's body.
pub fn check(data: &[u8]) {
    let [mode, max, split, rest @ ..] = data else {
        return;
    };
    let with_startup = mode & 1 == 1;
    // Small limits reach the length check with short inputs; the gateway's default is 1 GiB.
    let max = match max % 4 {
        0 => 1 << 30,
        1 => 5,
        2 => 64,
        _ => 4096,
    };
    let whole = parse_pieces(&[rest], with_startup, max);
    let split = parse_pieces(&crate::pieces(rest, *split), with_startup, max);
    assert_eq!(whole, split, "split delivery changed the messages");
    for frame in &whole.frames {
        assert!(frame.raw.len() >= 5);
        let declared = u32::from_be_bytes([frame.raw[1], frame.raw[2], frame.raw[3], frame.raw[4]]);
        assert_eq!(frame.raw.len(), declared as usize + 1);
        assert_eq!(frame.tag, frame.raw[0]);
        read_bodies(frame);
    }
    if whole.error.is_none() {
        assert_eq!(read_with_reader(rest, with_startup, max), whole.frames);
    }
}

fn parse_pieces(pieces: &[&[u8]], with_startup: bool, max: usize) -> Outcome {
    let mut buf = BytesMut::new();
    let mut outcome = Outcome {
        startup: None,
        frames: Vec::new(),
        error: None,
    };
    let mut want_startup = with_startup;
    for piece in pieces {
        buf.extend_from_slice(piece);
        loop {
            let before = buf.len();
            let step = if want_startup {
                parse_startup(&mut buf).map(|s| {
                    s.map(|s| {
                        outcome.startup = Some(s);
                        want_startup = false;
                    })
                })
            } else {
                parse_frame(&mut buf, max).map(|f| f.map(|f| outcome.frames.push(f)))
            };
            match step {
                Ok(Some(())) => assert!(buf.len() < before, "a message consumed no bytes"),
                Ok(None) => break,
                Err(e) => {
                    outcome.error = Some(e);
                    return outcome;
                }
            }
        }
    }
    outcome
}

fn read_bodies(frame: &Frame) {
    let _ = query_text(frame);
    let _ = parse_fields(frame);
    let _ = bind_fields(frame);
    let _ = target_fields(frame);
    let _ = error_code_and_detail(frame);
    let mut lexing = Lexing::default();
    lexing.observe(frame.body());
    let _ = lexing.hazard();
}

/// The frames `FrameReader` reads from `bytes` (a stream that then ends).
fn read_with_reader(bytes: &[u8], with_startup: bool, max: usize) -> Vec<Frame> {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime")
    });
    runtime.block_on(async {
        let mut reader = FrameReader::new(bytes, max);
        let mut frames = Vec::new();
        if with_startup && !matches!(reader.read_startup().await, Ok(Some(_))) {
            return frames;
        }
        // Each frame is at least 5 bytes, so this ends.
        while let Ok(Some(frame)) = reader.read_frame().await {
            frames.push(frame);
        }
        frames
    })
}
