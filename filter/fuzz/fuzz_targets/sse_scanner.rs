//! Arbitrary response bytes fed to the Responses-id scanner in arbitrary
//! chunks, as SSE or JSON: never a panic, it ends by the bound, and an id it
//! finds is one the bytes contain.
#![no_main]

use kvroute_filter::observe::{IdScanner, Scan};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [chunk, mode, rest @ ..] = data else {
        return;
    };
    let cap = 64 + usize::from(mode >> 1) * 16;
    let mut scanner = IdScanner::new(cap, mode & 1 == 1);
    let pieces: Vec<&[u8]> = rest.chunks(usize::from(*chunk).max(1)).collect();
    let mut fed = 0usize;
    for (i, piece) in pieces.iter().enumerate() {
        fed += piece.len();
        match scanner.push(piece, i + 1 == pieces.len()) {
            Scan::NeedMore => assert!(fed < cap.max(1) || i + 1 < pieces.len()),
            Scan::GiveUp => return,
            Scan::Found(id) => {
                assert!(!id.is_empty());
                let needle = id.as_bytes();
                assert!(
                    rest.windows(needle.len()).any(|w| w == needle)
                        || rest.contains(&b'\\'),
                    "found an id the bytes do not hold"
                );
                return;
            }
        }
    }
});
