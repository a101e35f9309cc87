//! The machine a comparison ran on, and where its CPU went during each run.
//!
//! On two shared cores every process in the path (the server, the load generator,
//! Redis, MariaDB, the broker) competes for the same CPU, so a run's CPU split is
//! the first profile: a strategy whose processes add up to the machine's 200 % is
//! CPU-bound, and the split says by whom; one far below it waits on something
//! (a lock, a disk flush, a timer). "other" is whatever else ran on the machine at
//! the time (a compiler, say) and flags a noisy measurement.

use std::collections::BTreeMap;
use std::fs;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::clock::now_unix_ms;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub os: String,
    pub kernel: String,
    pub rustc: String,
    pub redis: String,
    pub redis_benchmark: String,
    pub mariadb: String,
    pub innodb_flush_log_at_trx_commit: String,
    pub broker: String,
    pub load_average_at_start: String,
}

/// First line of a command's output, or "unknown".
fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            let text = if o.stdout.is_empty() {
                o.stderr
            } else {
                o.stdout
            };
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .map(|l| l.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// What can be read without a database or Redis connection; the caller fills in
/// the servers' own versions.
pub fn describe() -> Machine {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    let memory_gib = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map(|kb| kb / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    let os = fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    let tansu = which("tansu").unwrap_or_else(|| {
        std::env::var("HOME")
            .map(|h| format!("{h}/.cargo/bin/tansu"))
            .unwrap_or_else(|_| "tansu".into())
    });
    Machine {
        cpus: std::thread::available_parallelism().map_or(0, |p| p.get()),
        cpu_model,
        memory_gib,
        os,
        kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "unknown".into()),
        rustc: command_line("rustc", &["--version"]),
        redis: String::new(),
        redis_benchmark: command_line("redis-benchmark", &["--version"]),
        mariadb: String::new(),
        innodb_flush_log_at_trx_commit: String::new(),
        broker: command_line(&tansu, &["--version"]),
        load_average_at_start: fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default(),
    }
}

fn which(program: &str) -> Option<String> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
}

/// Pids of running processes whose command name (`/proc/<pid>/comm`) is `name`.
pub fn pids_named(name: &str) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim() == name)
                .unwrap_or(false)
        })
        .collect()
}

/// (pid, command name, CPU ticks) of every process, to name what else ran.
pub fn process_table() -> Vec<(u32, String, u64)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter_map(|pid| {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            Some((pid, comm.trim().to_owned(), process_ticks(pid)?))
        })
        .collect()
}

/// The busiest processes between two [`process_table`] snapshots taken `seconds`
/// apart, leaving out `known` pids: (name, % of one core), at most `n`.
pub fn busiest_others(
    before: &[(u32, String, u64)],
    after: &[(u32, String, u64)],
    known: &[u32],
    seconds: f64,
    n: usize,
) -> Vec<(String, f64)> {
    let ticks_per_second = clock_ticks_per_second();
    let start: BTreeMap<u32, u64> = before.iter().map(|(p, _, t)| (*p, *t)).collect();
    // Several processes of one name (rustc, say) add up.
    let mut by_name: BTreeMap<String, u64> = BTreeMap::new();
    for (pid, comm, end) in after {
        if known.contains(pid) {
            continue;
        }
        // A process born during the run counts from zero.
        let delta = end.saturating_sub(start.get(pid).copied().unwrap_or(0));
        if delta > 0 {
            *by_name.entry(comm.clone()).or_insert(0) += delta;
        }
    }
    let mut list: Vec<(String, f64)> = by_name
        .into_iter()
        .map(|(k, t)| (k, t as f64 / ticks_per_second / seconds.max(0.001) * 100.0))
        .filter(|(_, pct)| *pct >= 1.0)
        .collect();
    list.sort_by(|a, b| b.1.total_cmp(&a.1));
    list.truncate(n);
    list
}

/// utime + stime of a process (all its threads), in clock ticks.
fn process_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces; the fields after its ")" are fixed:
    // state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// (resident now, peak resident) of a process in KiB (`VmRSS`, `VmHWM`).
pub fn process_memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// CPU seconds (user + system, all threads) a process has used so far.
pub fn process_cpu_s(pid: u32) -> Option<f64> {
    Some(process_ticks(pid)? as f64 / clock_ticks_per_second())
}

/// (busy, total) ticks of the whole machine, from the first line of /proc/stat.
fn machine_ticks() -> Option<(u64, u64)> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy = v.first()? + v.get(1)? + v.get(2)? + v.get(5)? + v.get(6)? + v.get(7)?;
    let total = busy + v.get(3)? + v.get(4)?;
    Some((busy, total))
}

fn clock_ticks_per_second() -> f64 {
    command_line("getconf", &["CLK_TCK"])
        .parse()
        .unwrap_or(100.0)
}

#[derive(Debug, Clone)]
struct CpuSample {
    t_unix_ms: f64,
    machine: Option<(u64, u64)>,
    /// role → (pid, ticks)
    roles: BTreeMap<String, (u32, u64)>,
}

/// CPU use in one window, in percent of one core (the machine's maximum is
/// cores × 100 %).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CpuWindow {
    pub seconds: f64,
    pub by_process: BTreeMap<String, f64>,
    pub machine_busy: f64,
    /// Busy time not accounted to any named process.
    pub other: f64,
}

/// Samples the CPU time of named roles (processes) every 250 ms on its own thread.
pub struct CpuSampler {
    roles: Arc<Mutex<BTreeMap<String, u32>>>,
    samples: Arc<Mutex<Vec<CpuSample>>>,
    stop: CancellationToken,
    thread: Option<JoinHandle<()>>,
    ticks_per_second: f64,
    cpus: usize,
}

impl CpuSampler {
    pub fn start() -> anyhow::Result<CpuSampler> {
        let roles: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
        let samples: Arc<Mutex<Vec<CpuSample>>> = Arc::default();
        let stop = CancellationToken::new();
        let thread = {
            let (roles, samples, stop) = (roles.clone(), samples.clone(), stop.clone());
            std::thread::Builder::new()
                .name("cpu-sampler".into())
                .spawn(move || {
                    while !stop.is_cancelled() {
                        let current = roles.lock().unwrap_or_else(|p| p.into_inner()).clone();
                        let sample = CpuSample {
                            t_unix_ms: now_unix_ms(),
                            machine: machine_ticks(),
                            roles: current
                                .into_iter()
                                .filter_map(|(role, pid)| {
                                    process_ticks(pid).map(|t| (role, (pid, t)))
                                })
                                .collect(),
                        };
                        samples
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(sample);
                        std::thread::sleep(Duration::from_millis(250));
                    }
                })?
        };
        Ok(CpuSampler {
            roles,
            samples,
            stop,
            thread: Some(thread),
            ticks_per_second: clock_ticks_per_second(),
            cpus: std::thread::available_parallelism().map_or(1, |p| p.get()),
        })
    }

    /// Pids currently followed.
    pub fn tracked_pids(&self) -> Vec<u32> {
        self.roles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .copied()
            .collect()
    }

    /// Follows `pid` under `role` from now on (replacing an earlier pid).
    pub fn track(&self, role: &str, pid: u32) {
        self.roles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(role.to_owned(), pid);
    }

    pub fn untrack(&self, role: &str) {
        self.roles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(role);
    }

    /// CPU per role between the samples closest to `[from, to]` (unix ms).
    pub fn window(&self, from_unix_ms: f64, to_unix_ms: f64) -> CpuWindow {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        // The last sample at or before the start, the first at or after the end.
        let a = samples
            .iter()
            .rposition(|s| s.t_unix_ms <= from_unix_ms)
            .unwrap_or(0);
        let b = samples
            .iter()
            .position(|s| s.t_unix_ms >= to_unix_ms)
            .unwrap_or(samples.len().saturating_sub(1));
        let (Some(sa), Some(sb)) = (samples.get(a), samples.get(b)) else {
            return CpuWindow::default();
        };
        let seconds = (sb.t_unix_ms - sa.t_unix_ms) / 1000.0;
        if seconds <= 0.0 || b <= a {
            return CpuWindow::default();
        }
        let span = &samples[a..=b];
        let mut by_process = BTreeMap::new();
        let mut accounted_ticks = 0u64;
        let roles: std::collections::BTreeSet<&String> =
            span.iter().flat_map(|s| s.roles.keys()).collect();
        for role in roles {
            // A process may start after the window opens or exit before it closes
            // (the load generator does both, and the previous run's may still be
            // exiting when the window opens): follow the process the role names at
            // its last sample inside the window, from its first sample with that pid.
            let Some(last) = span.iter().rev().find(|s| s.roles.contains_key(role)) else {
                continue;
            };
            let Some((pid, end)) = last.roles.get(role) else {
                continue;
            };
            let Some(first) = span
                .iter()
                .find(|s| s.roles.get(role).is_some_and(|(p, _)| p == pid))
            else {
                continue;
            };
            let Some((_, start)) = first.roles.get(role) else {
                continue;
            };
            let secs = (last.t_unix_ms - first.t_unix_ms) / 1000.0;
            if secs <= 0.0 {
                continue;
            }
            let ticks = end.saturating_sub(*start);
            accounted_ticks += ticks;
            by_process.insert(
                role.clone(),
                ticks as f64 / self.ticks_per_second / secs * 100.0,
            );
        }
        let machine_busy = match (sa.machine, sb.machine) {
            (Some((busy0, total0)), Some((busy1, total1))) if total1 > total0 => {
                (busy1 - busy0) as f64 / (total1 - total0) as f64 * self.cpus as f64 * 100.0
            }
            _ => 0.0,
        };
        let accounted = accounted_ticks as f64 / self.ticks_per_second / seconds * 100.0;
        CpuWindow {
            seconds,
            by_process,
            machine_busy,
            other: (machine_busy - accounted).max(0.0),
        }
    }

    pub fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
