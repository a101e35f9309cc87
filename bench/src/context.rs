//! What every section of a comparison shares: the options, the service's settings,
//! the child binaries, the CPU sampler, the side query and the sale counter.

use std::path::PathBuf;

use anyhow::Context as _;
use flashsale::config::Settings;
use hyper::{Method, StatusCode};
use secrecy::ExposeSecret;
use serde_json::json;
use testkit::sale::SaleSpec;

use crate::client::expect_json;
use crate::machine::CpuSampler;
use crate::options::SuiteOptions;
use crate::process::{Loadtest, ServerChild};
use crate::server::StrategyKind;
use crate::side::SideQuery;

pub struct Bench {
    pub opts: SuiteOptions,
    pub settings: Settings,
    pub loadtest: Loadtest,
    pub server_bin: PathBuf,
    /// `runs/` beside the report: each run's JSON and the sections' scratch files.
    pub runs_dir: PathBuf,
    pub cpu: CpuSampler,
    pub side: SideQuery,
    /// For the test kit's sale set-up and the admin API.
    pub http: reqwest::Client,
    sale_counter: u32,
}

impl Bench {
    pub fn new(
        opts: SuiteOptions,
        settings: Settings,
        loadtest: Loadtest,
        server_bin: PathBuf,
        runs_dir: PathBuf,
        cpu: CpuSampler,
        side: SideQuery,
    ) -> Bench {
        Bench {
            opts,
            settings,
            loadtest,
            server_bin,
            runs_dir,
            cpu,
            side,
            http: reqwest::Client::new(),
            sale_counter: 0,
        }
    }

    pub fn admin_token(&self) -> String {
        self.settings.auth.admin_token.expose_secret().to_owned()
    }

    /// A SKU no other run of this or an earlier comparison used.
    pub fn next_sku(&mut self, strategy: StrategyKind, what: &str) -> String {
        self.sale_counter += 1;
        format!(
            "bench-{}-{what}-{}-{}",
            strategy.name(),
            self.sale_counter,
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        )
    }

    /// A `bench-server` of this comparison's options; `env` overrides settings.
    pub async fn start_server(
        &self,
        strategy: StrategyKind,
        env: &[(&str, String)],
    ) -> anyhow::Result<ServerChild> {
        ServerChild::start(&self.server_bin, &self.opts, strategy, env, &[]).await
    }

    /// A second instance of the service `first` runs (same database, topic and
    /// consumer group), as a deployment's second machine would be.
    pub async fn join_server(&self, first: &ServerChild) -> anyhow::Result<ServerChild> {
        let args = ["--join".to_owned(), first.announce.run_id.clone()];
        ServerChild::start(
            &self.server_bin,
            &self.opts,
            StrategyKind::Service,
            &[],
            &args,
        )
        .await
    }

    /// Opens a sale of `stock` units: `/bench/sales` for a–c and the no-op, the
    /// test kit's operator sequence (create, preload) for the service. Returns the
    /// service's activity id.
    pub async fn open_sale(
        &self,
        server: &ServerChild,
        sku: &str,
        stock: u64,
    ) -> anyhow::Result<Option<String>> {
        if server.announce.strategy != StrategyKind::Service {
            expect_json(
                server.addr,
                Method::POST,
                "/bench/sales",
                None,
                Some(&json!({ "sku": sku, "stock": stock })),
                StatusCode::CREATED,
            )
            .await?;
            return Ok(None);
        }
        let spec = SaleSpec {
            sku: Some(sku.to_owned()),
            payment_timeout_secs: 3600,
            ..SaleSpec::new(u32::try_from(stock).context("stock too large for a sale")?)
        };
        Ok(Some(self.open_service_sale(server, &spec).await?))
    }

    /// Opens the service's sale as the test kit describes it; returns its id.
    pub async fn open_service_sale(
        &self,
        server: &ServerChild,
        spec: &SaleSpec,
    ) -> anyhow::Result<String> {
        let base = format!("http://{}", server.addr);
        let sale = testkit::sale::open_sale(&self.http, &base, &self.admin_token(), spec)
            .await
            .map_err(|e| anyhow::anyhow!(e))
            .context("the sale did not open")?;
        Ok(sale.id)
    }
}
