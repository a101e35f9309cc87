//! The flood, measured with `wrk` (one thread, the suite's connections, every
//! user with a token of their own): what one request costs the service in each
//! phase of a sale, against `GET /healthz` and an authenticated no-op behind the
//! same layers.
//!
//! Phases, each a `wrk` run of `--flood-duration` seconds; the first four take
//! turns for `--flood-rounds` rounds and the median round of each is reported:
//! - `healthz`: `GET /healthz` on the service (no script: wrk's fastest path);
//! - `no-op`: `POST /flash/{sku}/reserve` on the no-op strategy's server;
//! - `sold out`: the same on the service, its one unit sold: `409 sold_out`;
//! - `refused by window`: a sale that starts in half an hour: `403 not_started`;
//! - `waiting room: join` and `waiting room: where do I stand`: the crowd joins a
//!   waiting room (`201` once, then `200`), then polls its place (`200`);
//! - `winning`: a sale with a unit for every user: `202` (each waits for the broker).
//!
//! For each: requests per second, latency, the server process's CPU seconds and
//! Redis's commands during the run, both divided by the requests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use hyper::{Method, StatusCode};
use serde::Deserialize;
use testkit::sale::SaleSpec;
use tokio::process::Command;

use crate::client::call_json;
use crate::context::Bench;
use crate::loadgen::{issue_tokens, signer, UserToken};
use crate::machine;
use crate::model::{FloodRun, FloodSection};
use crate::process::ServerChild;
use crate::redis_info;
use crate::server::StrategyKind;

/// Rotates through the users' tokens, one request each in turn; the requests are
/// built once, in `init`, so `request` costs a table lookup.
const TOKENS_LUA: &str = r#"
local reqs = {}
local n = 0
local i = 0
init = function(args)
  for line in io.lines(args[1]) do
    n = n + 1
    reqs[n] = wrk.format(args[2], nil, { ["Authorization"] = line }, nil)
  end
end
request = function()
  i = i + 1
  if i > n then i = 1 end
  return reqs[i]
end
"#;

/// Prints wrk's own figures as one JSON line.
const DONE_LUA: &str = r#"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%.0f,"duration_us":%.0f,"status":%.0f,"socket":%.0f,"p50_us":%.0f,"p99_us":%.0f}\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"#;

#[derive(Deserialize)]
struct WrkOut {
    requests: u64,
    duration_us: f64,
    status: u64,
    socket: u64,
    p50_us: f64,
    p99_us: f64,
}

/// One phase's request: where it goes and with which users.
struct Target<'a> {
    phase: &'a str,
    server: &'a ServerChild,
    method: Method,
    path: String,
    /// A file of `Bearer …` lines; `None` sends no token (and no script per request).
    tokens: Option<&'a Path>,
    expected: &'a str,
}

pub async fn section(bench: &mut Bench) -> anyhow::Result<FloodSection> {
    let wrk = wrk_version().await?;
    let dir = bench.runs_dir.join("flood");
    std::fs::create_dir_all(&dir).with_context(|| format!("failed to create {}", dir.display()))?;
    let auth = signer(&bench.settings.auth)?;
    let users = bench.opts.small_users;
    let crowd = write_tokens(&dir, "crowd", &issue_tokens(&auth, "flood-", users, 3600)?)?;
    // More winners than a run can serve at the broker's pace: each request is a
    // user's first.
    let winners = 60_000;
    let winning = write_tokens(
        &dir,
        "winners",
        &issue_tokens(&auth, "flood-winner-", winners, 3600)?,
    )?;
    write_script(&dir, "tokens.lua", &format!("{TOKENS_LUA}{DONE_LUA}"))?;
    write_script(&dir, "plain.lua", DONE_LUA)?;

    let mut section = FloodSection {
        wrk,
        threads: 1,
        connections: bench.opts.concurrency,
        users,
        runs: Vec::new(),
    };

    // Both servers run throughout (the idle one costs nothing), so the phases
    // that are compared take turns, round after round, and noise from the rest
    // of the machine falls on all of them alike.
    let noop = bench.start_server(StrategyKind::Noop, &[]).await?;
    let service = bench.start_server(StrategyKind::Service, &[]).await;
    let runs = match &service {
        Ok(service) => phases(bench, &noop, service, &crowd, &winning, winners).await,
        Err(e) => Err(anyhow::anyhow!("the service did not start: {e:#}")),
    };
    noop.stop().await?;
    if let Ok(service) = service {
        service.stop().await?;
    }
    section.runs = runs?;
    Ok(section)
}

/// The compared phases (`/healthz`, the no-op, sold out, refused by window) on
/// servers of configuration `config_env` with `env` set, their logs written to
/// `runs/flood/*-{label}.log`. Returns the runs and the bytes the service logged.
pub async fn compared_in(
    bench: &mut Bench,
    config_env: &str,
    env: &[(&str, String)],
    label: &str,
) -> anyhow::Result<(Vec<FloodRun>, u64)> {
    let dir = bench.runs_dir.join("flood");
    std::fs::create_dir_all(&dir).with_context(|| format!("failed to create {}", dir.display()))?;
    let auth = signer(&bench.settings.auth)?;
    let crowd = write_tokens(
        &dir,
        "crowd",
        &issue_tokens(&auth, "flood-", bench.opts.small_users, 3600)?,
    )?;
    let winner = write_tokens(
        &dir,
        &format!("winner-{label}"),
        &issue_tokens(&auth, &format!("flood-{label}-winner-"), 1, 3600)?,
    )?;
    write_script(&dir, "tokens.lua", &format!("{TOKENS_LUA}{DONE_LUA}"))?;
    write_script(&dir, "plain.lua", DONE_LUA)?;
    let noop_log = dir.join(format!("noop-{label}.log"));
    let service_log = dir.join(format!("service-{label}.log"));
    let noop = bench
        .start_server_in(StrategyKind::Noop, config_env, env, Some(&noop_log))
        .await?;
    let service = bench
        .start_server_in(StrategyKind::Service, config_env, env, Some(&service_log))
        .await;
    let runs = match &service {
        Ok(service) => compared_phases(bench, &noop, service, &crowd, &winner).await,
        Err(e) => Err(anyhow::anyhow!("the service did not start: {e:#}")),
    };
    noop.stop().await?;
    if let Ok(service) = service {
        service.stop().await?;
    }
    let logged = crate::process::keep_log_head(&service_log)?;
    crate::process::keep_log_head(&noop_log)?;
    Ok((runs?, logged))
}

/// The compared phases in `--flood-rounds` rounds (the median round of each is
/// kept), then the waiting room's and the winning phases once.
async fn phases(
    bench: &mut Bench,
    noop: &ServerChild,
    service: &ServerChild,
    crowd: &Path,
    winning: &Path,
    winners: usize,
) -> anyhow::Result<Vec<FloodRun>> {
    let mut runs = compared_phases(bench, noop, service, crowd, winning).await?;
    runs.extend(room_phases(bench, service, crowd).await?);
    runs.push(winning_phase(bench, service, winning, winners).await?);
    Ok(runs)
}

/// The no-op, `/healthz`, the sold-out sale and the sale not yet open, taking
/// turns round after round; the median round of each.
async fn compared_phases(
    bench: &mut Bench,
    noop: &ServerChild,
    service: &ServerChild,
    crowd: &Path,
    winning: &Path,
) -> anyhow::Result<Vec<FloodRun>> {
    let noop_sku = bench.next_sku(StrategyKind::Noop, "flood");
    bench.open_sale(noop, &noop_sku, 1_000_000).await?;
    let sold_sku = sold_out_sale(bench, service, winning).await?;
    let upcoming = SaleSpec {
        sku: Some(bench.next_sku(StrategyKind::Service, "flood-upcoming")),
        starts_in_secs: 1800,
        ..SaleSpec::new(100)
    };
    bench.open_service_sale(service, &upcoming).await?;

    let compared = [
        Target {
            phase: "no-op",
            server: noop,
            method: Method::POST,
            path: format!("/flash/{noop_sku}/reserve"),
            tokens: Some(crowd),
            expected: "202",
        },
        Target {
            phase: "healthz",
            server: service,
            method: Method::GET,
            path: "/healthz".into(),
            tokens: None,
            expected: "200",
        },
        Target {
            phase: "sold out",
            server: service,
            method: Method::POST,
            path: format!("/flash/{sold_sku}/reserve"),
            tokens: Some(crowd),
            expected: "409 sold_out",
        },
        Target {
            phase: "refused by window",
            server: service,
            method: Method::POST,
            path: format!(
                "/flash/{}/reserve",
                upcoming.sku.as_deref().unwrap_or_default()
            ),
            tokens: Some(crowd),
            expected: "403 not_started",
        },
    ];
    let rounds = bench.opts.flood_rounds.max(1);
    let mut measured: Vec<Vec<FloodRun>> = vec![Vec::new(); compared.len()];
    for round in 1..=rounds {
        eprintln!("== flood: round {round} of {rounds}");
        for (i, target) in compared.iter().enumerate() {
            measured[i].push(measure(bench, target).await?);
        }
    }
    Ok(measured.into_iter().map(median_round).collect())
}

/// A sale of one unit, bought (by the first winner's token) before the flood.
/// Returns its SKU.
async fn sold_out_sale(
    bench: &mut Bench,
    service: &ServerChild,
    winning: &Path,
) -> anyhow::Result<String> {
    let sold = SaleSpec {
        sku: Some(bench.next_sku(StrategyKind::Service, "flood-sold-out")),
        ..SaleSpec::new(1)
    };
    bench.open_service_sale(service, &sold).await?;
    let sold_sku = sold.sku.clone().unwrap_or_default();
    let buyer = first_token(winning)?;
    let (status, body) = call_json(
        service.addr,
        Method::POST,
        &format!("/flash/{sold_sku}/reserve"),
        Some(&buyer),
        None,
    )
    .await?;
    if status != StatusCode::ACCEPTED {
        bail!("the sold-out sale's one unit was not sold: {status} {body}");
    }
    Ok(sold_sku)
}

/// A waiting room five minutes before its start: the crowd joins, then asks
/// where it stands (each user their own token).
async fn room_phases(
    bench: &mut Bench,
    service: &ServerChild,
    crowd: &Path,
) -> anyhow::Result<Vec<FloodRun>> {
    let room = SaleSpec {
        sku: Some(bench.next_sku(StrategyKind::Service, "flood-room")),
        starts_in_secs: 300,
        waiting_room: true,
        ..SaleSpec::new(100)
    };
    bench.open_service_sale(service, &room).await?;
    let queue = format!("/flash/{}/queue", room.sku.as_deref().unwrap_or_default());
    let mut runs = Vec::new();
    for (phase, method, expected) in [
        ("waiting room: join", Method::POST, "201"),
        ("waiting room: where do I stand", Method::GET, "200"),
    ] {
        let target = Target {
            phase,
            server: service,
            method,
            path: queue.clone(),
            tokens: Some(crowd),
            expected,
        };
        runs.push(measure(bench, &target).await?);
    }
    Ok(runs)
}

/// A sale with a unit for every winner: each request a `202`.
async fn winning_phase(
    bench: &mut Bench,
    service: &ServerChild,
    winning: &Path,
    winners: usize,
) -> anyhow::Result<FloodRun> {
    let open = SaleSpec {
        sku: Some(bench.next_sku(StrategyKind::Service, "flood-winning")),
        payment_timeout_secs: 3600,
        ..SaleSpec::new(u32::try_from(winners).context("too many winners")?)
    };
    bench.open_service_sale(service, &open).await?;
    let target = Target {
        phase: "winning",
        server: service,
        method: Method::POST,
        path: format!("/flash/{}/reserve", open.sku.as_deref().unwrap_or_default()),
        tokens: Some(winning),
        expected: "202",
    };
    measure(bench, &target).await
}

/// The round with the median throughput, every round's throughput beside it.
fn median_round(mut rounds: Vec<FloodRun>) -> FloodRun {
    let all: Vec<f64> = rounds.iter().map(|r| r.rps).collect();
    rounds.sort_by(|a, b| a.rps.total_cmp(&b.rps));
    let mut median = rounds.swap_remove(rounds.len() / 2);
    median.rps_rounds = all;
    median
}

/// One `wrk` run against `target`, with the server's CPU and Redis's commands.
async fn measure(bench: &Bench, target: &Target<'_>) -> anyhow::Result<FloodRun> {
    let dir = bench.runs_dir.join("flood");
    let url = format!("http://{}{}", target.server.addr, target.path);
    let pid = target
        .server
        .pid()
        .context("the server has no process id")?;
    let redis_url = &bench.settings.redis.url;
    // The probe's own answer is part of the figures' meaning: record it.
    let probe = probe(target).await?;
    let redis_before = redis_info::counters(redis_url).await?;
    let cpu_before = machine::process_cpu_s(pid);
    let duration = Duration::from_secs_f64(bench.opts.flood_duration);
    let mut cmd = Command::new("wrk");
    cmd.args(["-t1", &format!("-c{}", bench.opts.concurrency)])
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("--latency");
    match target.tokens {
        Some(tokens) => {
            cmd.arg("-s")
                .arg(dir.join("tokens.lua"))
                .arg(&url)
                .arg("--")
                .arg(tokens)
                .arg(target.method.as_str());
        }
        None => {
            cmd.arg("-s").arg(dir.join("plain.lua")).arg(&url);
        }
    }
    eprintln!("== flood: {} ({url})", target.phase);
    let out = tokio::time::timeout(duration + Duration::from_secs(60), cmd.output())
        .await
        .context("wrk overran its time bound")?
        .context("failed to run wrk (scripts/bench.sh installs it)")?;
    let cpu_after = machine::process_cpu_s(pid);
    let redis_after = redis_info::counters(redis_url).await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "wrk failed ({}): {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("WRK_JSON "))
        .with_context(|| format!("wrk printed no figures: {stdout}"))?;
    let w: WrkOut = serde_json::from_str(line).context("wrk's figures do not parse")?;
    let seconds = w.duration_us / 1e6;
    Ok(FloodRun {
        phase: target.phase.to_owned(),
        request: format!("{} {}", target.method, target.path),
        expected: target.expected.to_owned(),
        probe,
        requests: w.requests,
        seconds,
        rps: w.requests as f64 / seconds.max(1e-9),
        p50_ms: w.p50_us / 1000.0,
        p99_ms: w.p99_us / 1000.0,
        non_2xx: w.status,
        socket_errors: w.socket,
        server_cpu_s: cpu_after.zip(cpu_before).map(|(a, b)| a - b),
        redis_commands: Some(redis_after.commands.saturating_sub(redis_before.commands)),
        rps_rounds: Vec::new(),
    })
}

/// One request like the phase's (the tokens file's last user), answered as what?
async fn probe(target: &Target<'_>) -> anyhow::Result<String> {
    let token = match target.tokens {
        Some(path) => Some(last_token(path)?),
        None => None,
    };
    let (status, body) = call_json(
        target.server.addr,
        target.method.clone(),
        &target.path,
        token.as_deref(),
        None,
    )
    .await?;
    Ok(match body["code"].as_str() {
        Some(code) => format!("{} {code}", status.as_u16()),
        None => status.as_u16().to_string(),
    })
}

async fn wrk_version() -> anyhow::Result<String> {
    let out = Command::new("wrk")
        .arg("-v")
        .output()
        .await
        .context("wrk is not installed (scripts/bench.sh installs it)")?;
    // `wrk -v` prints its version and exits 1.
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    Ok(text
        .lines()
        .next()
        .and_then(|l| l.split(" Copyright").next())
        .unwrap_or("wrk")
        .trim()
        .to_owned())
}

fn write_tokens(dir: &Path, name: &str, users: &[UserToken]) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("{name}.tokens"));
    let mut text = String::with_capacity(users.len() * 200);
    for u in users {
        text.push_str(
            u.authorization
                .to_str()
                .context("a token is not printable")?,
        );
        text.push('\n');
    }
    std::fs::write(&path, text).with_context(|| format!("failed to write {}", path.display()))?;
    Ok(path)
}

fn write_script(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, text).with_context(|| format!("failed to write {}", path.display()))
}

/// The token (without `Bearer `) on the first or last line of a tokens file.
fn token_at(path: &Path, last: bool) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("failed to read {}", path.display()))?;
    let mut lines = text.lines();
    let line = if last { lines.last() } else { lines.next() };
    line.and_then(|l| l.strip_prefix("Bearer "))
        .map(str::to_owned)
        .with_context(|| format!("{} holds no token", path.display()))
}

fn first_token(path: &Path) -> anyhow::Result<String> {
    token_at(path, false)
}

fn last_token(path: &Path) -> anyhow::Result<String> {
    token_at(path, true)
}
