//! The gRPC service (`kvroute.v1.Index`): thin glue from tonic to
//! [`crate::pick`]. Errors become `tonic::Status` via `RequestError`'s
//! `From` impl in [`crate::error`].

use std::sync::Arc;
use std::time::Instant;

use kvroute_proto::v1::index_server::{Index, IndexServer};
use kvroute_proto::v1::{ObserveRequest, ObserveResponse, PickRequest, PickResponse};
use tonic::{Request, Response, Status};

use crate::pick;
use crate::state::Shared;

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

    /// The tonic server wrapper.
    pub fn into_server(self) -> IndexServer<Self> {
        IndexServer::new(self)
    }
}

#[tonic::async_trait]
impl Index for IndexService {
    async fn pick(&self, request: Request<PickRequest>) -> Result<Response<PickResponse>, Status> {
        let started = Instant::now();
        let result = pick::pick(&self.shared, request.get_ref(), started);
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
