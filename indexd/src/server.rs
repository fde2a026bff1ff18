//! The gRPC service (`kvroute.v1.Index`): thin glue from tonic to
//! [`crate::pick`], behind the token check of [`crate::auth`]. Errors become
//! `tonic::Status` via the `From` impls in [`crate::error`].

use std::sync::Arc;
use std::time::Instant;

use kvroute_proto::v1::index_server::{Index, IndexServer};
use kvroute_proto::v1::{
    Api as WireApi, DecisionKind, ObserveRequest, ObserveResponse, PickRequest, PickResponse,
    TokenizerSource,
};
use kvroute_proto::{BlockSize, SCHEME_VERSION, block_keys};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use crate::auth::GrpcAuth;
use crate::pick;
use crate::state::Shared;
use crate::tokenize::{Api, Source, Via};

/// The tonic service over the shared state.
#[derive(Debug, Clone)]
pub struct IndexService {
    shared: Arc<Shared>,
}

impl IndexService {
    /// A service answering from `shared`.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// The tonic server wrapper behind the token check; a Pick may carry a
    /// request body up to `tokenize.max_body_bytes`.
    pub fn into_server(self) -> InterceptedService<IndexServer<Self>, GrpcAuth<Shared>> {
        let limit = self
            .shared
            .tokenizers
            .config()
            .max_body_bytes
            .saturating_add(64 << 10);
        let auth = GrpcAuth::new(Arc::clone(&self.shared));
        InterceptedService::new(
            IndexServer::new(self).max_decoding_message_size(limit),
            auth,
        )
    }
}

#[tonic::async_trait]
impl Index for IndexService {
    async fn pick(&self, request: Request<PickRequest>) -> Result<Response<PickResponse>, Status> {
        let mut req = request.into_inner();
        if !req.body.is_empty() {
            return Ok(Response::new(self.pick_body(&mut req).await?));
        }
        let started = Instant::now();
        let result = pick::pick(&self.shared, &req, started);
        self.shared.metrics.pick_latency.observe(started.elapsed());
        Ok(Response::new(result?))
    }

    async fn observe(
        &self,
        request: Request<ObserveRequest>,
    ) -> Result<Response<ObserveResponse>, Status> {
        pick::observe(&self.shared, request.get_ref(), Instant::now())?;
        Ok(Response::new(ObserveResponse {}))
    }
}

impl IndexService {
    /// A Pick carrying its request body: tokenize (locally or by a replica),
    /// key the full blocks, pick. A body that cannot be tokenized is
    /// answered UNTOKENIZED, so the filter goes on without an override.
    async fn pick_body(&self, req: &mut PickRequest) -> Result<PickResponse, Status> {
        let api = match WireApi::try_from(req.api) {
            Ok(WireApi::Completions) => Api::Completions,
            Ok(WireApi::Chat) => Api::Chat,
            Ok(WireApi::Responses) => Api::Responses,
            Ok(WireApi::Messages) => Api::Messages,
            Ok(WireApi::Unspecified) | Err(_) => {
                return Err(Status::invalid_argument("a Pick with a body needs its api"));
            }
        };
        if !req.block_keys.is_empty() {
            return Err(Status::invalid_argument(
                "a Pick carries block_keys or a body, not both",
            ));
        }
        let body = std::mem::take(&mut req.body);
        // The body again for a shadow check beside the Pick (a reference).
        let shadow_body = body.clone();
        let block_size = BlockSize::new(req.block_size).unwrap_or(self.shared.config.block_size);
        let cap = self.shared.config.max_pick_keys;
        // No more ids than the keys a Pick looks at, nor than it takes to
        // know the prompt is longer than vLLM admits.
        let mut max_tokens = cap.saturating_mul(block_size.get() as usize);
        if let Some(limit) = self.shared.tokenizers.max_model_len(&req.model) {
            max_tokens = max_tokens.min((limit as usize).saturating_add(1));
        }
        let tokenized = self
            .shared
            .tokenizers
            .tokenize(
                self.shared.as_ref(),
                Via::Pick,
                api,
                &req.model,
                body,
                Some(max_tokens),
            )
            .await;
        let t = match tokenized {
            Ok(t) => t,
            Err(e) => {
                self.shared.untokenized.note(&req.model, &e);
                self.shared
                    .metrics
                    .decisions
                    .inc(["untokenized", e.label()]);
                return Ok(PickResponse {
                    decision: DecisionKind::Untokenized as i32,
                    reason: e.to_string(),
                    ..PickResponse::default()
                });
            }
        };
        if t.source == Source::Local && self.shared.tokenizers.shadow_due(&req.model) {
            let shared = Arc::clone(&self.shared);
            let model = req.model.clone();
            let ids = t.ids.clone();
            let truncated = ids.len() >= max_tokens;
            tokio::spawn(async move {
                shared
                    .tokenizers
                    .shadow_beside(shared.as_ref(), api, &model, &shadow_body, ids, truncated)
                    .await;
            });
        }
        let keys = block_keys(&t.ids, block_size, t.salt.as_deref());
        req.block_keys = keys.iter().take(cap).map(|k| k.as_u64()).collect();
        req.key_scheme = SCHEME_VERSION.to_owned();
        req.block_size = block_size.get();
        req.prompt_tokens = u32::try_from(t.ids.len()).unwrap_or(u32::MAX);
        req.continuation = req.continuation.or(t.continuation);
        let started = Instant::now();
        let result = pick::pick(&self.shared, req, started);
        self.shared.metrics.pick_latency.observe(started.elapsed());
        let mut answer = result?;
        answer.prompt_tokens = req.prompt_tokens;
        answer.tokenizer = match t.source {
            Source::Local => TokenizerSource::Local,
            Source::Replica => TokenizerSource::Replica,
        } as i32;
        Ok(answer)
    }
}
