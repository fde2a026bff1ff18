//! Reason labels and the metrics the filter emits.
//!
//! Counters are named `kvroute.decisions.<reason>` (Envoy's Prometheus
//! output shows them as `kvroute_decisions_<reason>`); histograms record
//! microseconds.

/// Why a request was or was not given an override (the failure table of the README).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// indexd matched the request's exact blocks.
    Precise,
    /// `previous_response_id` named the replica holding the response.
    Affinity,
    /// Ranked by learned text-chunk keys.
    Approximate,
    /// No replica holds a block: ranked by load.
    Load,
    /// indexd could not route it (down, breaker open, stale): sent where its
    /// conversation's previous turn went.
    Remembered,
    /// A continuation sent where its previous turn went, from the memory,
    /// without asking indexd (`local_continuations`).
    Continued,
    /// Body over `max_body_bytes`.
    BodyTooLarge,
    /// Bad JSON, missing fields, no model.
    Unparseable,
    /// Media or embeddings.
    IncompleteIdentity,
    /// Tokenizer error, non-200, timeout or garbage.
    TokenizeFailed,
    /// Fewer tokens than one block.
    ShortPrompt,
    /// indexd timed out, was unreachable or answered garbage.
    IndexUnavailable,
    /// indexd refused this request (InvalidArgument, OutOfRange): not a
    /// failure of indexd, so the breaker does not count it.
    IndexRejected,
    /// Envoy refused the Pick at once: the indexd cluster's circuit breaker
    /// is full. Not a failure of indexd: the breaker does not count it.
    IndexBusy,
    /// The shared index circuit breaker is open.
    BreakerOpen,
    /// The shared tokenizer circuit breaker is open.
    TokenizerBreakerOpen,
    /// indexd has no fresh, healthy replica.
    IndexStale,
}

impl Reason {
    /// Every reason, in metric-definition order.
    pub const ALL: [Self; 17] = [
        Self::Precise,
        Self::Affinity,
        Self::Approximate,
        Self::Load,
        Self::Remembered,
        Self::Continued,
        Self::BodyTooLarge,
        Self::Unparseable,
        Self::IncompleteIdentity,
        Self::TokenizeFailed,
        Self::ShortPrompt,
        Self::IndexUnavailable,
        Self::IndexRejected,
        Self::IndexBusy,
        Self::BreakerOpen,
        Self::TokenizerBreakerOpen,
        Self::IndexStale,
    ];

    /// The label used in metrics, logs and the decision header.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Precise => "precise",
            Self::Affinity => "affinity",
            Self::Approximate => "approximate",
            Self::Load => "load",
            Self::Remembered => "remembered",
            Self::Continued => "continued",
            Self::BodyTooLarge => "body_too_large",
            Self::Unparseable => "unparseable",
            Self::IncompleteIdentity => "incomplete_identity",
            Self::TokenizeFailed => "tokenize_failed",
            Self::ShortPrompt => "short_prompt",
            Self::IndexUnavailable => "index_unavailable",
            Self::IndexRejected => "index_rejected",
            Self::IndexBusy => "index_busy",
            Self::BreakerOpen => "breaker_open",
            Self::TokenizerBreakerOpen => "tokenizer_breaker_open",
            Self::IndexStale => "index_stale",
        }
    }

    /// Whether the request was given an override.
    pub const fn routed(self) -> bool {
        matches!(
            self,
            Self::Precise
                | Self::Affinity
                | Self::Approximate
                | Self::Load
                | Self::Remembered
                | Self::Continued
        )
    }
}

/// Counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Counter {
    /// `kvroute.decisions.<reason>`.
    Decision(Reason),
    /// `kvroute.breaker.opened`: the index breaker went from closed to open.
    BreakerOpened,
    /// `kvroute.tokenizer_breaker.opened`: the tokenizer breaker opened.
    TokenizerBreakerOpened,
    /// `kvroute.observe.sent`.
    ObserveSent,
    /// `kvroute.observe.failed`: Observe could not be dispatched or failed.
    ObserveFailed,
    /// `kvroute.index.block_size_mismatch`: indexd sees another block size.
    BlockSizeMismatch,
    /// `kvroute.index.key_scheme_mismatch`: indexd keys blocks with another
    /// scheme than this filter.
    KeySchemeMismatch,
    /// `kvroute.index.large_pick_failed`: a Pick of more than 1 MiB (its
    /// body) failed or timed out: the request went on unrouted, and the
    /// index breaker did not count it (a client's large bodies cannot open
    /// it for everyone).
    LargePickFailed,
    /// `kvroute.continuations.busy`: a continuation asked for a Pick rather
    /// than follow its previous turn, whose replica indexd's latest answer
    /// called busy (`local_continuations`).
    ContinuationBusy,
    /// `kvroute.continuations.unknown_load`: a continuation asked for a Pick
    /// because no answer of indexd's in the last second said which replicas
    /// are busy (`local_continuations`).
    ContinuationUnknownLoad,
}

impl Counter {
    /// Every counter, in definition order.
    pub fn all() -> Vec<Self> {
        let mut all: Vec<Self> = Reason::ALL.iter().map(|r| Self::Decision(*r)).collect();
        all.extend([
            Self::BreakerOpened,
            Self::TokenizerBreakerOpened,
            Self::ObserveSent,
            Self::ObserveFailed,
            Self::BlockSizeMismatch,
            Self::KeySchemeMismatch,
            Self::LargePickFailed,
            Self::ContinuationBusy,
            Self::ContinuationUnknownLoad,
        ]);
        all
    }

    /// The metric name.
    pub fn name(self) -> String {
        match self {
            Self::Decision(r) => format!("kvroute.decisions.{}", r.label()),
            Self::BreakerOpened => "kvroute.breaker.opened".to_owned(),
            Self::TokenizerBreakerOpened => "kvroute.tokenizer_breaker.opened".to_owned(),
            Self::ObserveSent => "kvroute.observe.sent".to_owned(),
            Self::ObserveFailed => "kvroute.observe.failed".to_owned(),
            Self::BlockSizeMismatch => "kvroute.index.block_size_mismatch".to_owned(),
            Self::KeySchemeMismatch => "kvroute.index.key_scheme_mismatch".to_owned(),
            Self::LargePickFailed => "kvroute.index.large_pick_failed".to_owned(),
            Self::ContinuationBusy => "kvroute.continuations.busy".to_owned(),
            Self::ContinuationUnknownLoad => "kvroute.continuations.unknown_load".to_owned(),
        }
    }
}

/// Histograms, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Histogram {
    /// `kvroute.filter_duration_us`: request headers to resume (callouts included).
    FilterTime,
    /// `kvroute.tokenizer_duration_us`: the tokenizer call.
    TokenizerCall,
    /// `kvroute.index_duration_us`: the Pick call.
    IndexCall,
    /// `kvroute.request_work_us`: the filter's own work on a request body
    /// (parsing, the tokenizer call's body), from the body's end to the
    /// first callout.
    RequestWork,
    /// `kvroute.answer_work_us`: the filter's own work on a tokenizer answer
    /// (token ids, block keys, the Pick message).
    AnswerWork,
}

impl Histogram {
    /// Every histogram, in definition order.
    pub const ALL: [Self; 5] = [
        Self::FilterTime,
        Self::TokenizerCall,
        Self::IndexCall,
        Self::RequestWork,
        Self::AnswerWork,
    ];

    /// The metric name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::FilterTime => "kvroute.filter_duration_us",
            Self::TokenizerCall => "kvroute.tokenizer_duration_us",
            Self::IndexCall => "kvroute.index_duration_us",
            Self::RequestWork => "kvroute.request_work_us",
            Self::AnswerWork => "kvroute.answer_work_us",
        }
    }
}

/// Gauges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gauge {
    /// `kvroute.vm_memory_bytes`: a VM's linear memory (it never shrinks, so
    /// this is the high-water mark of the last VM to finish a request).
    VmMemory,
}

impl Gauge {
    /// Every gauge, in definition order.
    pub const ALL: [Self; 1] = [Self::VmMemory];

    /// The metric name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::VmMemory => "kvroute.vm_memory_bytes",
        }
    }
}
