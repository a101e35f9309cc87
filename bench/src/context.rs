//! What every section of a comparison shares: the options, the service's settings,
//! the child binaries, the CPU sampler, the side query and the sale counter;
//! started before the first section and stopped after the last.

use std::path::PathBuf;

use anyhow::Context as _;
use flashsale::config::{KafkaSettings, Settings};
use hyper::{Method, StatusCode};
use secrecy::ExposeSecret;
use serde_json::json;
use sqlx::migrate::MigrateDatabase;
use sqlx::MySql;
use testkit::invariants::Probe;
use testkit::sale::SaleSpec;

use crate::client::expect_json;
use crate::machine::{self, CpuSampler};
use crate::options::SuiteOptions;
use crate::process::{sibling, Loadtest, ServerChild};
use crate::server::StrategyKind;
use crate::side::SideQuery;
use crate::with_database;

pub struct Bench {
    pub opts: SuiteOptions,
    pub settings: Settings,
    pub loadtest: Loadtest,
    pub server_bin: PathBuf,
    /// `runs/` beside the report: each run's JSON and the sections' scratch files.
    pub runs_dir: PathBuf,
    pub cpu: CpuSampler,
    pub side: SideQuery,
    /// The side query's own database, dropped by [`Bench::stop`].
    side_db: String,
    /// For the test kit's sale set-up and the admin API.
    pub http: reqwest::Client,
    sale_counter: u32,
    /// Activities whose Redis keys a section deletes once their service stopped.
    pub forget: Vec<String>,
}

impl Bench {
    /// Finds the child binaries beside this one, makes `runs/`, starts the CPU
    /// sampler (Redis, MariaDB and the broker tracked from the start) and the
    /// side query in a database of its own on the same server.
    pub async fn start(opts: SuiteOptions, settings: Settings) -> anyhow::Result<Bench> {
        let loadtest = Loadtest {
            bin: sibling("loadtest")?,
            opts: opts.clone(),
        };
        let server_bin = sibling("bench-server")?;
        let runs_dir = opts.out.join("runs");
        std::fs::create_dir_all(&runs_dir)
            .with_context(|| format!("failed to create {}", runs_dir.display()))?;
        let cpu = CpuSampler::start()?;
        for (role, name) in [
            ("redis", "redis-server"),
            ("mariadb", "mariadbd"),
            ("broker", "tansu"),
        ] {
            if let Some(pid) = machine::pids_named(name).into_iter().next() {
                cpu.track(role, pid);
            }
        }
        // The other business: its own database on the same server.
        let side_db = format!(
            "flashsale_bench_side_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let side_url = with_database(settings.mysql.url.expose_secret(), &side_db);
        MySql::create_database(&side_url)
            .await
            .context("failed to create the side database")?;
        let side = SideQuery::start(&side_url, opts.side_rate).await?;
        Ok(Bench {
            opts,
            settings,
            loadtest,
            server_bin,
            runs_dir,
            cpu,
            side,
            side_db,
            http: reqwest::Client::new(),
            sale_counter: 0,
            forget: Vec::new(),
        })
    }

    /// Stops the side query and the sampler, and drops the side query's
    /// database (a failure is only reported: the next run drops it).
    pub async fn stop(self) {
        self.side.stop();
        self.cpu.stop();
        let side_url = with_database(self.settings.mysql.url.expose_secret(), &self.side_db);
        if let Err(err) = MySql::drop_database(&side_url).await {
            eprintln!("could not drop {}: {err}", self.side_db);
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

    /// A `bench-server` with the configuration of environment `config_env`
    /// (`config/{config_env}.toml`) instead of the comparison's, its log
    /// written to `log` when given.
    pub async fn start_server_in(
        &self,
        strategy: StrategyKind,
        config_env: &str,
        env: &[(&str, String)],
        log: Option<&std::path::Path>,
    ) -> anyhow::Result<ServerChild> {
        let opts = SuiteOptions {
            env: config_env.to_owned(),
            ..self.opts.clone()
        };
        ServerChild::start_logged(&self.server_bin, &opts, strategy, env, &[], log).await
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

    /// The test kit's invariant checker on one of the service's sales, the
    /// service's stock in `redis_url`.
    pub fn probe(&self, server: &ServerChild, redis_url: String, activity: &str) -> Probe {
        let announce = &server.announce;
        Probe {
            mysql_url: with_database(self.settings.mysql.url.expose_secret(), &announce.database),
            redis_url,
            activity_id: activity.to_owned(),
            kafka: KafkaSettings {
                topic: announce.topic.clone().unwrap_or_default(),
                group_id: announce.group.clone().unwrap_or_default(),
                ..self.settings.kafka.clone()
            },
        }
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
