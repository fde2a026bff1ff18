//! `mock-vllm`: parse flags, start one replica, print its bound addresses as one JSON line on
//! stdout, serve until Ctrl-C or SIGTERM.

use std::process::ExitCode;

use clap::Parser;
use mock_vllm::{Cli, MockVllm};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mock-vllm: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.into_config()?;
    let handle = MockVllm::start(config).await?;
    println!("{}", serde_json::to_string(handle.addresses())?);
    shutdown_signal().await?;
    handle.shutdown().await;
    Ok(())
}

async fn shutdown_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}
