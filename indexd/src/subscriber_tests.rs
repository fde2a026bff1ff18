//! A stream-level differential test: random event streams through the real
//! [`Stream`] (sequence tracking, replays, restarts, duplicates) against the
//! naive index model fed with what the engine actually did.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute_proto::keys::block_keys;
use proptest::prelude::*;
use rmpv::Value;
use tokio_util::sync::CancellationToken;

use super::replay::Replay;
use super::*;
use crate::config::{Config, EndpointConfig};
use crate::event::{ExtraKeys, KvEvent};
use crate::index::model::{BLOCK, Extra, Naive, Op, Prompt, bs, event, op, prompt};
use crate::zmtp::Frame;

fn encode(ev: &KvEvent, ts: f64) -> Vec<u8> {
    let hashes = |hs: &[crate::event::EngineHash]| {
        Value::Array(hs.iter().map(|h| Value::from(h.0)).collect())
    };
    let tier = |t: crate::event::Tier| Value::from(t.label().to_uppercase());
    let ev = match ev {
        KvEvent::BlockStored(s) => {
            let mut fields: Vec<(Value, Value)> = vec![
                ("type".into(), "BlockStored".into()),
                ("block_hashes".into(), hashes(&s.block_hashes)),
                (
                    "parent_block_hash".into(),
                    s.parent.map_or(Value::Nil, |p| Value::from(p.0)),
                ),
                (
                    "token_ids".into(),
                    Value::Array(s.token_ids.iter().map(|t| Value::from(*t)).collect()),
                ),
                ("block_size".into(), Value::from(s.block_size)),
                ("medium".into(), tier(s.tier)),
                (
                    "lora_name".into(),
                    s.lora_name.as_deref().map_or(Value::Nil, Value::from),
                ),
                ("group_idx".into(), Value::from(s.group_idx)),
            ];
            // As vLLM lists them: the LoRA name first in every block's keys,
            // then the salt (block 0); the field omitted when not carried.
            if let Some(extra) = &s.extra_keys {
                let lora = s.lora_name.as_deref().map(Value::from);
                let per_block = extra.iter().map(|e| {
                    let mut keys: Vec<Value> = lora.iter().cloned().collect();
                    match e {
                        ExtraKeys::None => {}
                        ExtraKeys::Salt(salt) => keys.push(Value::from(salt.as_str())),
                        ExtraKeys::Unkeyable => keys.push(Value::Binary(vec![1])),
                    }
                    if keys.is_empty() {
                        Value::Nil
                    } else {
                        Value::Array(keys)
                    }
                });
                fields.push(("extra_keys".into(), Value::Array(per_block.collect())));
            }
            Value::Map(fields)
        }
        KvEvent::BlockRemoved(r) => Value::Map(vec![
            ("type".into(), "BlockRemoved".into()),
            ("block_hashes".into(), hashes(&r.block_hashes)),
            ("medium".into(), tier(r.tier)),
            ("group_idx".into(), Value::from(r.group_idx)),
        ]),
        KvEvent::AllBlocksCleared => Value::Map(vec![("type".into(), "AllBlocksCleared".into())]),
        KvEvent::Unknown => Value::Map(vec![("type".into(), "Novel".into())]),
    };
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::from(ts), Value::Array(vec![ev])]),
    )
    .unwrap();
    out
}

/// The publisher side of one engine process: seqs and a bounded buffer.
#[derive(Debug)]
struct Engine {
    next_seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
    cap: usize,
}

impl Engine {
    fn publish(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer.push_back((seq, payload));
        if self.buffer.len() > self.cap {
            self.buffer.pop_front();
        }
        seq
    }
}

/// Serves replays from the engine's buffer, in either reply format.
#[derive(Debug)]
struct FakeReplay {
    engine: Arc<Mutex<Engine>>,
    queue: VecDeque<Vec<Bytes>>,
    legacy: bool,
    available: bool,
    /// Answers cut as vLLM's ROUTER cuts them when its send queue fills:
    /// after `.0` batches the rest is lost, the end marker included; with
    /// `.1`, only the next `.0` batches are lost and the rest (end marker
    /// included) arrives.
    cut: Option<(usize, bool)>,
}

impl Replay for FakeReplay {
    async fn request(&mut self, from: u64) -> bool {
        if !self.available {
            return false;
        }
        let engine = self.engine.lock().unwrap();
        let frame = |seq: u64, payload: Bytes| {
            let mut f = vec![Bytes::new()];
            if !self.legacy {
                f.push(Bytes::from_static(b"kv@t@m"));
            }
            f.extend([Bytes::copy_from_slice(&seq.to_be_bytes()), payload]);
            f
        };
        self.queue = engine
            .buffer
            .iter()
            .filter(|(s, _)| *s >= from)
            .map(|(s, p)| frame(*s, Bytes::from(p.clone())))
            .collect();
        self.queue.push_back(if self.legacy {
            vec![Bytes::new(), Bytes::from_static(&[0xff; 8]), Bytes::new()]
        } else {
            vec![
                Bytes::new(),
                Bytes::new(),
                Bytes::from_static(&[0xff; 8]),
                Bytes::new(),
            ]
        });
        if let Some((window, resume)) = self.cut
            && self.queue.len() > window + 1
        {
            let rest = self.queue.split_off(window);
            if resume {
                self.queue.extend(rest.into_iter().skip(window));
            }
        }
        true
    }

    async fn next_reply(&mut self) -> Option<Vec<Frame>> {
        let frames = self.queue.pop_front()?;
        Some(frames.into_iter().map(Frame::from).collect())
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// The engine publishes a batch; `dropped`: lost on the live path (it
    /// stays in the buffer).
    Publish { op: Op, dropped: bool },
    /// Up to `n` queued live messages reach the subscriber, in order.
    Deliver { n: usize },
    /// The engine restarts behind the same socket: seqs from 0, empty cache.
    RestartSameSocket,
    /// The engine restarts and the subscriber reconnects (queued messages
    /// are lost with the connection).
    RestartReconnect,
    /// The subscriber reconnects to the same engine (indexd restarted, the
    /// connection broke): queued messages are lost, the buffer replays.
    Reconnect,
    /// Compare a prompt's match.
    Query(Prompt),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (op(), prop::bool::weighted(0.25)).prop_map(|(op, dropped)| Step::Publish { op, dropped }),
        4 => (1usize..4).prop_map(|n| Step::Deliver { n }),
        1 => Just(Step::RestartSameSocket),
        1 => Just(Step::RestartReconnect),
        1 => Just(Step::Reconnect),
        3 => prompt().prop_map(Step::Query),
    ]
}

/// Runs `steps`; with `exact`, a synced index must equal the model, else it
/// must never claim more than the model (loss is forgotten, not invented).
fn run(
    steps: &[Step],
    cap: usize,
    legacy: bool,
    available: bool,
    cut: Option<(usize, bool)>,
    exact: bool,
) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let shared = Shared::new(Config::new(Vec::new()), CancellationToken::new());
        let replica = shared
            .add_replica(EndpointConfig::new(
                SocketAddr::from(([127, 0, 0, 1], 1)),
                "m",
            ))
            .unwrap();
        let engine = Arc::new(Mutex::new(Engine {
            next_seq: 0,
            buffer: VecDeque::new(),
            cap,
        }));
        let replay = FakeReplay {
            engine: Arc::clone(&engine),
            queue: VecDeque::new(),
            legacy,
            available,
            cut,
        };
        let mut stream = Stream::new(&shared, &replica, replay);
        stream.resync(false).await;

        let mut naive = Naive::default();
        let mut live: VecDeque<Vec<Bytes>> = VecDeque::new();
        let mut ts = 0.0;
        // The last batch published was lost live (indexd cannot know yet).
        let mut last_dropped = false;
        // A same-socket restart is detected by the new engine's first batch.
        let mut restart_pending = false;
        for step in steps {
            match step {
                Step::Publish { op, dropped } => {
                    let Some((_, ev)) = event(op) else { continue };
                    ts += 1.0;
                    let payload = encode(&ev, ts);
                    let seq = engine.lock().unwrap().publish(payload.clone());
                    naive.apply(0, "m", &ev);
                    let dropped = *dropped && !restart_pending;
                    if !dropped {
                        live.push_back(vec![
                            Bytes::from_static(b"kv@t@m"),
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            Bytes::from(payload),
                        ]);
                        restart_pending = false;
                    }
                    last_dropped = dropped;
                }
                Step::Deliver { n } => {
                    for _ in 0..*n {
                        let Some(frames) = live.pop_front() else {
                            break;
                        };
                        stream.on_live(frames).await;
                    }
                }
                Step::RestartSameSocket => {
                    let mut e = engine.lock().unwrap();
                    e.next_seq = 0;
                    e.buffer.clear();
                    naive.replicas.clear();
                    restart_pending = true;
                }
                Step::RestartReconnect => {
                    {
                        let mut e = engine.lock().unwrap();
                        e.next_seq = 0;
                        e.buffer.clear();
                    }
                    naive.replicas.clear();
                    live.clear();
                    stream.resync(true).await;
                    last_dropped = false;
                    restart_pending = false;
                }
                Step::Reconnect => {
                    live.clear();
                    stream.resync(true).await;
                    // A batch dropped right before the end marker cannot be
                    // seen in the answer: the next live batch shows the gap.
                    last_dropped = matches!(cut, Some((_, true)));
                    restart_pending = false;
                }
                Step::Query(p) => {
                    let synced = live.is_empty() && !last_dropped && !restart_pending;
                    if !synced {
                        continue;
                    }
                    let keys = block_keys(&p.tokens(0..p.ids.len()), bs(BLOCK), p.salt);
                    let index = shared.index.locked();
                    let got = index.match_prefix(
                        index.partition(p.model()),
                        &keys,
                        &[replica.slot],
                        std::time::Instant::now(),
                    )[0];
                    let want = naive.matched(0, p.model(), &keys);
                    if exact {
                        prop_assert_eq!((got.blocks, got.per_tier), want, "prompt {:?}", p);
                    } else {
                        prop_assert!(
                            got.blocks <= want.0,
                            "index claims {} > {} for {:?}",
                            got.blocks,
                            want.0,
                            p
                        );
                    }
                }
            }
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    /// The buffer holds everything: every gap heals, every restart is seen.
    #[test]
    fn stream_with_a_full_buffer_equals_the_engine(steps in prop::collection::vec(step(), 1..80), legacy in any::<bool>()) {
        run(&steps, usize::MAX, legacy, true, None, true)?;
    }

    /// Replay answers cut short on the way (vLLM's ROUTER drops what
    /// exceeds its send queue, the end marker too): read in pages, every
    /// gap still heals.
    #[test]
    fn stream_with_replay_answers_cut_short_equals_the_engine(
        steps in prop::collection::vec(step(), 1..80),
        window in 1usize..4,
        resume in any::<bool>(),
    ) {
        run(&steps, usize::MAX, false, true, Some((window, resume)), true)?;
    }

    /// A tiny buffer (or none reachable) loses history: indexd may
    /// forget, never invent.
    #[test]
    fn stream_with_a_wrapping_buffer_never_overclaims(
        steps in prop::collection::vec(step(), 1..80),
        cap in 1usize..4,
        available in any::<bool>(),
    ) {
        run(&steps, cap, false, available, None, false)?;
    }
}

#[test]
fn a_restarted_engine_reusing_replayed_seqs_is_not_taken_for_duplicates() {
    // Start-up replay delivers seqs 0..=2; the engine then restarts and its
    // new seq 1 arrives live: same seq as a replayed batch, other bytes.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let shared = Shared::new(Config::new(Vec::new()), CancellationToken::new());
        let replica = shared
            .add_replica(EndpointConfig::new(
                SocketAddr::from(([127, 0, 0, 1], 1)),
                "m",
            ))
            .unwrap();
        let engine = Arc::new(Mutex::new(Engine {
            next_seq: 0,
            buffer: VecDeque::new(),
            cap: 100,
        }));
        let empty = |ts: f64| {
            let mut out = Vec::new();
            rmpv::encode::write_value(
                &mut out,
                &Value::Array(vec![Value::from(ts), Value::Array(vec![])]),
            )
            .unwrap();
            out
        };
        for ts in 0..3 {
            engine.lock().unwrap().publish(empty(f64::from(ts)));
        }
        let replay = FakeReplay {
            engine: Arc::clone(&engine),
            queue: VecDeque::new(),
            legacy: false,
            available: true,
            cut: None,
        };
        let mut stream = Stream::new(&shared, &replica, replay);
        stream.resync(false).await;
        assert_eq!(stream.tracker.next, Some(3));
        // The live copy of replayed seq 1: a duplicate.
        let frames = |seq: u64, p: Vec<u8>| {
            vec![
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(p),
            ]
        };
        stream.on_live(frames(1, empty(1.0))).await;
        assert_eq!(shared.metrics.duplicates.get(), 1);
        assert_eq!(shared.metrics.purges.get(["restart"]), 0);
        // A restarted engine's seq 1 (other bytes): a restart.
        {
            let mut e = engine.lock().unwrap();
            e.next_seq = 0;
            e.buffer.clear();
            e.publish(empty(10.0));
            e.publish(empty(11.0));
        }
        stream.on_live(frames(1, empty(11.0))).await;
        assert_eq!(shared.metrics.purges.get(["restart"]), 1);
        assert_eq!(stream.tracker.next, Some(2));
    });
}

#[test]
fn a_gap_without_replay_purges_rather_than_keep_stale_blocks() {
    let p = Prompt {
        salt: None,
        lora: None,
        ids: vec![1, 2],
    };
    let q = Prompt {
        salt: None,
        lora: None,
        ids: vec![2],
    };
    let store = |p: &Prompt| Step::Publish {
        op: Op::Store {
            slot: 0,
            p: p.clone(),
            start: 0,
            tier: crate::event::Tier::Gpu,
            group: 0,
            unkeyable_at: None,
            extra: Extra::Full,
        },
        dropped: false,
    };
    let steps = vec![
        store(&p),
        Step::Deliver { n: 1 },
        Step::Publish {
            op: Op::Clear { slot: 0 },
            dropped: true,
        },
        store(&q),
        Step::Deliver { n: 1 },
        Step::Query(p.clone()),
        Step::Query(q),
    ];
    run(&steps, 100, false, false, None, true).unwrap();
}

#[path = "subscriber_resume_tests.rs"]
mod resume;
