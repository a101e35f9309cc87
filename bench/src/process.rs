//! The benchmark's child processes: a `bench-server` (one strategy, or the real
//! service) and a `loadtest` run, each supervised from the orchestrator.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use crate::loadgen::LoadReport;
use crate::machine::CpuSampler;
use crate::options::SuiteOptions;
use crate::server::{Announce, RateLimitMode, StrategyKind};

/// The sibling binaries (`loadtest`, `bench-server`) built with this one.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let path = exe
        .parent()
        .context("this executable has no folder")?
        .join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: build the bench crate's binaries together (cargo build --release -p flashsale-bench)",
            path.display()
        );
    }
    Ok(path)
}

/// A running `bench-server`.
pub struct ServerChild {
    child: Child,
    pub announce: Announce,
    pub addr: SocketAddr,
    /// Reads the server's output to its end (into the log file, if any).
    reader: tokio::task::JoinHandle<()>,
}

impl ServerChild {
    pub async fn start(
        bin: &Path,
        opts: &SuiteOptions,
        strategy: StrategyKind,
        env: &[(&str, String)],
        args: &[String],
    ) -> anyhow::Result<ServerChild> {
        Self::start_logged(bin, opts, strategy, env, args, None).await
    }

    /// Like [`ServerChild::start`], its log (standard error) written to `log`
    /// instead of this process's standard error.
    pub async fn start_logged(
        bin: &Path,
        opts: &SuiteOptions,
        strategy: StrategyKind,
        env: &[(&str, String)],
        args: &[String],
        log: Option<&Path>,
    ) -> anyhow::Result<ServerChild> {
        // The service logs to standard output (its announcement is the first line
        // that parses as one) and may write to standard error: both go to `log`.
        let log_file = log
            .map(|path| {
                std::fs::File::create(path)
                    .with_context(|| format!("failed to create {}", path.display()))
            })
            .transpose()?;
        let stderr = match &log_file {
            Some(file) => Stdio::from(file.try_clone().context("failed to share the log file")?),
            None => Stdio::inherit(),
        };
        let mut child = Command::new(bin)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .arg("--strategy")
            .arg(strategy.name())
            .arg("--config")
            .arg(opts.repo.join("config"))
            .args(["--env", &opts.env])
            .args(["--mysql-pool", &opts.mysql_pool.to_string()])
            .args(["--lock-retry-ms", &opts.lock_retry_ms.to_string()])
            .args([
                "--rate-limits",
                match opts.rate_limits {
                    RateLimitMode::Off => "off",
                    RateLimitMode::Permissive => "permissive",
                },
            ])
            .args(args)
            .arg("--stop-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            // If this process dies, the child goes with it (and its stdin closes).
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("failed to start {}", bin.display()))?;
        let stdout = child
            .stdout
            .take()
            .context("the server's stdout is not piped")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut log_file = log_file.map(tokio::fs::File::from_std);
        let announce = tokio::time::timeout(Duration::from_secs(90), async {
            loop {
                let line = lines
                    .next_line()
                    .await
                    .context("failed to read the server's output")?
                    .context("the server exited before announcing its port")?;
                // A log line before the announcement (JSON logs at info).
                match serde_json::from_str::<Announce>(&line) {
                    Ok(a) => return anyhow::Ok(a),
                    Err(_) if log_file.is_some() || line.starts_with('{') => {
                        if let Some(f) = log_file.as_mut() {
                            f.write_all(format!("{line}\n").as_bytes()).await.ok();
                        }
                    }
                    Err(e) => bail!("unexpected first line from the server: {line}: {e}"),
                }
            }
        })
        .await
        .context("the server did not start within 90 s")??;
        // Keep reading, so the child can never block on a full pipe; the log
        // lines go to the log file when there is one.
        let reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(f) = log_file.as_mut() {
                    f.write_all(format!("{line}\n").as_bytes()).await.ok();
                }
            }
            if let Some(f) = log_file.as_mut() {
                f.flush().await.ok();
            }
        });
        let addr = SocketAddr::from(([127, 0, 0, 1], announce.port));
        Ok(ServerChild {
            child,
            announce,
            addr,
            reader,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Closes the child's stdin (its stop signal) and waits for a clean exit.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        drop(self.child.stdin.take());
        match tokio::time::timeout(Duration::from_secs(40), self.child.wait()).await {
            Ok(status) => {
                let status = status.context("failed to wait for the server")?;
                // Its output is complete once it exited: the log is whole.
                tokio::time::timeout(Duration::from_secs(5), self.reader)
                    .await
                    .ok();
                if !status.success() {
                    bail!("the server exited with {status}");
                }
                Ok(())
            }
            Err(_) => {
                self.child.kill().await.ok();
                bail!("the server did not stop within 40 s and was killed")
            }
        }
    }
}

/// The size of a server's log, which is then cut to its first 64 KiB (enough
/// to see what it says, without keeping a log of millions of requests).
pub fn keep_log_head(path: &Path) -> anyhow::Result<u64> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(0);
    };
    let size = meta.len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .with_context(|| format!("failed to open {}", path.display()))?;
    file.set_len(size.min(64 * 1024))
        .with_context(|| format!("failed to cut {}", path.display()))?;
    Ok(size)
}

/// What one loadtest run is asked to do.
pub struct LoadArgs {
    pub label: String,
    pub sku: String,
    pub users: usize,
    pub clicks: u32,
    /// Requests per second (open loop); `None` for the suite's fixed concurrency.
    pub rate: Option<f64>,
    pub duration: f64,
    pub warmup: f64,
    /// Units on sale, for the clients' invariant check.
    pub units: Option<u64>,
}

/// The `loadtest` binary, started once per measured run.
pub struct Loadtest {
    pub bin: PathBuf,
    pub opts: SuiteOptions,
}

/// A `loadtest` child still running; [`RunningLoad::finish`] collects its report.
pub struct RunningLoad {
    child: Child,
    json_path: PathBuf,
    bound: Duration,
    pub pid: Option<u32>,
}

impl Loadtest {
    /// Starts a run against `addr`, its report to be written to `json_path`.
    pub fn spawn(
        &self,
        addr: SocketAddr,
        args: &LoadArgs,
        json_path: PathBuf,
    ) -> anyhow::Result<RunningLoad> {
        let opts = &self.opts;
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--url", &format!("http://{addr}")])
            .args(["--sku", &args.sku])
            .args(["--users", &args.users.to_string()])
            .args(["--clicks", &args.clicks.to_string()])
            .args(["--concurrency", &opts.concurrency.to_string()])
            .args(["--duration", &(args.duration + args.warmup).to_string()])
            .args(["--warmup", &args.warmup.to_string()])
            .args(["--timeout", &opts.request_timeout.to_string()])
            .arg("--config")
            .arg(opts.repo.join("config"))
            .args(["--env", &opts.env])
            .args(["--label", &args.label])
            .arg("--json")
            .arg(&json_path)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(rate) = args.rate {
            cmd.args(["--rate", &format!("{rate:.1}")]);
        }
        if let Some(units) = args.units {
            cmd.args(["--stock", &units.to_string()]);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("failed to start {}", self.bin.display()))?;
        Ok(RunningLoad {
            pid: child.id(),
            child,
            json_path,
            bound: Duration::from_secs_f64(args.duration + args.warmup + 120.0),
        })
    }

    /// One whole run, the generator's CPU tracked as `loadgen` while it lasts.
    pub async fn run(
        &self,
        cpu: &CpuSampler,
        addr: SocketAddr,
        args: &LoadArgs,
        json_path: PathBuf,
    ) -> anyhow::Result<(LoadReport, Option<u32>)> {
        let running = self.spawn(addr, args, json_path)?;
        let pid = running.pid;
        if let Some(pid) = pid {
            cpu.track("loadgen", pid);
        }
        let report = running.finish().await;
        cpu.untrack("loadgen");
        Ok((report?, pid))
    }
}

impl RunningLoad {
    /// Waits for the run to end and reads its report.
    pub async fn finish(mut self) -> anyhow::Result<LoadReport> {
        let status = tokio::time::timeout(self.bound, self.child.wait())
            .await
            .context("the load generator overran its time bound")?
            .context("failed to wait for the load generator")?;
        if !status.success() {
            bail!("the load generator failed ({status})");
        }
        let text = std::fs::read_to_string(&self.json_path)
            .with_context(|| format!("failed to read {}", self.json_path.display()))?;
        serde_json::from_str(&text).context("the load generator's JSON does not parse")
    }
}
