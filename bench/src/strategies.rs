//! The strategies side by side: for each, a fresh `bench-server`, then three
//! `loadtest` runs against it (saturation, half rate, the small-stock sale), each
//! with the side query, the CPU and the server's own verdict.

use std::time::{Duration, Instant};

use anyhow::bail;
use hyper::{Method, StatusCode};
use serde_json::Value;

use crate::client::{call_json, expect_json};
use crate::context::Bench;
use crate::loadgen::LoadReport;
use crate::machine;
use crate::model::{Phase, ServerCheck, StrategyResult};
use crate::process::{LoadArgs, ServerChild};
use crate::server::StrategyKind;
use crate::verdict::{check_service, check_strategy};

impl Bench {
    /// Measures one strategy; a failure is recorded in the result, not raised.
    pub async fn strategy(&mut self, kind: StrategyKind) -> anyhow::Result<StrategyResult> {
        let mut result = StrategyResult {
            strategy: kind,
            name: kind.name().to_owned(),
            description: kind.describe().to_owned(),
            saturation: None,
            half_rate: None,
            small: None,
            error: None,
        };
        eprintln!("== {}: starting the server", kind.name());
        let server = self.start_server(kind, &[]).await?;
        if let Some(pid) = server.pid() {
            self.cpu.track("server", pid);
        }
        let outcome = self.strategy_runs(kind, &server, &mut result).await;
        self.cpu.untrack("server");
        let stopped = server.stop().await;
        if let Err(err) = outcome {
            result.error = Some(format!("{err:#}"));
            eprintln!("== {}: FAILED: {err:#}", kind.name());
        }
        if let Err(err) = stopped {
            eprintln!("== {}: {err:#}", kind.name());
        }
        Ok(result)
    }

    async fn strategy_runs(
        &mut self,
        kind: StrategyKind,
        server: &ServerChild,
        result: &mut StrategyResult,
    ) -> anyhow::Result<()> {
        let name = kind.name();
        let users = self.opts.users;

        eprintln!(
            "== {name}: saturation, {} connections",
            self.opts.concurrency
        );
        let sku = self.next_sku(kind, "sat");
        let args = LoadArgs {
            label: format!("{name} saturation"),
            sku,
            users,
            clicks: 1,
            rate: None,
            duration: self.opts.duration,
            warmup: self.opts.warmup,
            units: Some(users as u64),
        };
        let saturation = self
            .phase(
                server,
                args,
                users as u64,
                &format!("{name}-saturation.json"),
            )
            .await?;
        let rate = saturation.load.throughput_rps / 2.0;
        result.saturation = Some(saturation);

        if self.opts.half_rate_duration > 0.0 && rate > 0.0 {
            eprintln!("== {name}: half of saturation, {rate:.0} req/s");
            let sku = self.next_sku(kind, "half");
            let args = LoadArgs {
                label: format!("{name} half rate"),
                sku,
                users,
                clicks: 1,
                rate: Some(rate),
                duration: self.opts.half_rate_duration,
                warmup: self.opts.warmup.min(self.opts.half_rate_duration / 4.0),
                units: Some(users as u64),
            };
            result.half_rate = Some(
                self.phase(
                    server,
                    args,
                    users as u64,
                    &format!("{name}-half-rate.json"),
                )
                .await?,
            );
        }

        if self.opts.small_stock > 0 && kind != StrategyKind::Noop {
            let stock = self.opts.small_stock;
            eprintln!(
                "== {name}: small stock, {} units for {} users × {} clicks",
                stock, self.opts.small_users, self.opts.small_clicks
            );
            let sku = self.next_sku(kind, "small");
            let args = LoadArgs {
                label: format!("{name} small stock"),
                sku,
                users: self.opts.small_users,
                clicks: self.opts.small_clicks,
                rate: None,
                duration: self.opts.small_max_duration,
                warmup: 0.0,
                units: Some(stock),
            };
            result.small = Some(
                self.phase(server, args, stock, &format!("{name}-small-stock.json"))
                    .await?,
            );
        }
        Ok(())
    }
}

impl Bench {
    /// The server's view of a sale after a run, and the verdict on it. For the
    /// service, first waits until the consumer has written every order to MySQL.
    async fn inspect(
        &self,
        server: &ServerChild,
        sku: &str,
        activity: Option<&str>,
        load: &LoadReport,
    ) -> anyhow::Result<(Value, ServerCheck, Option<f64>)> {
        match (server.announce.strategy, activity) {
            (StrategyKind::Service, Some(id)) => self.inspect_service(server, id, load).await,
            (StrategyKind::Noop, _) => Ok((
                Value::Null,
                ServerCheck {
                    ok: true,
                    notes: vec!["no sale: the no-op holds nothing".into()],
                },
                None,
            )),
            _ => {
                let (status, state) = call_json(
                    server.addr,
                    Method::GET,
                    &format!("/bench/sales/{sku}"),
                    None,
                    None,
                )
                .await?;
                if status != StatusCode::OK {
                    bail!("sale state: {status} {state}");
                }
                let check = check_strategy(&state, load);
                Ok((state, check, None))
            }
        }
    }

    /// The service's sale once quiet, checked by the test kit's invariant checker
    /// (the same one the fault suite uses), plus: every `202` is an order.
    async fn inspect_service(
        &self,
        server: &ServerChild,
        activity: &str,
        load: &LoadReport,
    ) -> anyhow::Result<(Value, ServerCheck, Option<f64>)> {
        let probe = self.probe(server, self.settings.redis.url.clone(), activity);
        let started = Instant::now();
        let quiet = probe
            .wait_quiet(Duration::from_secs_f64(self.opts.drain_timeout))
            .await;
        let drain_s = quiet.is_ok().then(|| started.elapsed().as_secs_f64());
        let checked = probe.check(&[]).await;
        let state = expect_json(
            server.addr,
            Method::GET,
            &format!("/admin/activities/{activity}"),
            Some(&self.admin_token()),
            None,
            StatusCode::OK,
        )
        .await?;
        let check = check_service(quiet, checked, load);
        Ok((state, check, drain_s))
    }

    async fn phase(
        &mut self,
        server: &ServerChild,
        args: LoadArgs,
        stock: u64,
        file: &str,
    ) -> anyhow::Result<Phase> {
        let activity = self.open_sale(server, &args.sku, stock).await?;
        // Everything else that ran meanwhile, to name the noise.
        let before = machine::process_table();
        let started = Instant::now();
        let mut known = self.cpu.tracked_pids();
        known.push(std::process::id());
        let (load, loadgen_pid) = self
            .loadtest
            .run(&self.cpu, server.addr, &args, self.runs_dir.join(file))
            .await?;
        known.extend(loadgen_pid);
        let others = machine::busiest_others(
            &before,
            &machine::process_table(),
            &known,
            started.elapsed().as_secs_f64(),
            3,
        );
        let (server_state, check, drain_s) = self
            .inspect(server, &args.sku, activity.as_deref(), &load)
            .await?;
        let side = self
            .side
            .window(load.window_start_unix_ms, load.window_end_unix_ms)?;
        let cpu = self
            .cpu
            .window(load.window_start_unix_ms, load.window_end_unix_ms);
        Ok(Phase {
            load,
            side,
            cpu,
            others,
            server: server_state,
            check,
            drain_s,
        })
    }
}
