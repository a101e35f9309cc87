//! What a comparison measured: the data the suite fills in, `summary.json` holds
//! and the report renders. Nothing here runs anything.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ceiling::{BrokerCeiling, RedisCeiling};
use crate::loadgen::LoadReport;
use crate::machine::{CpuWindow, Machine};
use crate::mega::crowd::CrowdRun;
use crate::mega::scale::ScalePlan;
use crate::options::SuiteOptions;
use crate::server::StrategyKind;
use crate::side::SideStats;

/// The Cluster section's plan and its two runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterSection {
    pub plan: ClusterPlan,
    pub runs: Vec<ShardRun>,
}

/// A server-side verdict on a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ServerCheck {
    pub ok: bool,
    pub notes: Vec<String>,
}

/// One load run against one strategy, with what happened around it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Phase {
    pub load: LoadReport,
    pub side: SideStats,
    pub cpu: CpuWindow,
    /// The busiest processes outside the benchmark while the load generator ran
    /// (name, % of one core).
    pub others: Vec<(String, f64)>,
    /// The server's own view after the run (`/bench/sales/{sku}` or the admin API).
    pub server: Value,
    pub check: ServerCheck,
    /// Service only: seconds after the load until MySQL held every order.
    pub drain_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StrategyResult {
    pub strategy: StrategyKind,
    pub name: String,
    pub description: String,
    pub saturation: Option<Phase>,
    pub half_rate: Option<Phase>,
    pub small: Option<Phase>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub started_at: String,
    pub finished_at: String,
    pub seconds: f64,
    pub command: String,
    pub options: SuiteOptions,
    pub machine: Machine,
    pub side_idle: SideStats,
    pub cpu_idle: CpuWindow,
    pub redis_ceiling: Vec<RedisCeiling>,
    /// One publish in flight, then as many as the load test's connections.
    pub broker_ceiling: Vec<BrokerCeiling>,
    pub strategies: Vec<StrategyResult>,
    /// The hot SKU on a Redis Cluster, stock_shards 1 and 3 (`None`: skipped).
    #[serde(default)]
    pub cluster: Option<ClusterSection>,
    /// The flood measured with `wrk`: CPU per request by phase (`None`: skipped).
    #[serde(default)]
    pub flood: Option<FloodSection>,
    /// The sold-out gate reopening across instances (`None`: skipped).
    #[serde(default)]
    pub gate: Option<GateSection>,
    /// The producer's settings against the broker (`None`: skipped).
    #[serde(default)]
    pub producer: Option<ProducerSection>,
    /// Bots among the winners, open and through the waiting room (`None`: skipped).
    #[serde(default)]
    pub fairness: Option<FairnessSection>,
    /// A Redis Cluster primary killed under a sale (`None`: skipped).
    #[serde(default)]
    pub failover: Option<FailoverSection>,
    /// The mega-sale (`--mega`; `None`: not run).
    #[serde(default)]
    pub mega: Option<MegaSection>,
}

impl Summary {
    pub fn strategy(&self, kind: StrategyKind) -> Option<&StrategyResult> {
        self.strategies.iter().find(|s| s.strategy == kind)
    }
}

/// What the Cluster section sells.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterPlan {
    pub units: u32,
    pub users: usize,
    pub clicks: u32,
    pub connections: usize,
    pub request_timeout: Duration,
}

/// One Redis primary's share of a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PrimaryShare {
    pub port: u16,
    /// Which of the sale's stock shards it owns.
    pub shards: Vec<u8>,
    /// EVALSHA and EVAL calls it served during the run.
    pub script_calls: u64,
    /// CPU seconds it spent (user + system), all threads.
    pub cpu_s: f64,
}

/// One sale on the Cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardRun {
    pub stock_shards: u8,
    pub load: LoadReport,
    pub primaries: Vec<PrimaryShare>,
    /// CPU seconds of the service process during the run.
    pub service_cpu_s: Option<f64>,
}

impl ShardRun {
    pub fn script_calls(&self) -> u64 {
        self.primaries.iter().map(|p| p.script_calls).sum()
    }

    pub fn redis_cpu_s(&self) -> f64 {
        self.primaries.iter().map(|p| p.cpu_s).sum()
    }

    /// Script calls per answered request.
    pub fn calls_per_request(&self) -> f64 {
        self.script_calls() as f64 / self.load.answered.max(1) as f64
    }

    /// Redis CPU microseconds per script call, over every primary.
    pub fn us_per_call(&self) -> f64 {
        self.redis_cpu_s() * 1e6 / self.script_calls().max(1) as f64
    }

    /// The busiest primary's share of the calls.
    pub fn hottest_share(&self) -> f64 {
        let most = self
            .primaries
            .iter()
            .map(|p| p.script_calls)
            .max()
            .unwrap_or(0);
        most as f64 / self.script_calls().max(1) as f64
    }
}

/// One `wrk` run of the flood section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FloodRun {
    /// `healthz`, `no-op`, `sold out`, `refused by window`, `winning`.
    pub phase: String,
    /// The request, as sent.
    pub request: String,
    /// The answer every request of the phase should get, and what one probe got.
    pub expected: String,
    pub probe: String,
    pub requests: u64,
    pub seconds: f64,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Answers outside 2xx/3xx, as `wrk` counts them.
    pub non_2xx: u64,
    /// Connect, read, write errors and timeouts.
    pub socket_errors: u64,
    /// CPU seconds of the server process (all threads) during the run.
    pub server_cpu_s: Option<f64>,
    /// Commands Redis processed during the run (`total_commands_processed`).
    pub redis_commands: Option<u64>,
    /// Requests per second of every round, when the phase ran in rounds.
    #[serde(default)]
    pub rps_rounds: Vec<f64>,
}

impl FloodRun {
    pub fn cpu_us_per_request(&self) -> Option<f64> {
        self.server_cpu_s
            .map(|s| s * 1e6 / self.requests.max(1) as f64)
    }

    pub fn redis_commands_per_request(&self) -> Option<f64> {
        self.redis_commands
            .map(|c| c as f64 / self.requests.max(1) as f64)
    }
}

/// The flood measured with `wrk`: the service's reserve route against `/healthz`
/// and an authenticated no-op behind the same layers, and CPU per request by phase.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FloodSection {
    pub wrk: String,
    pub threads: u32,
    pub connections: usize,
    pub users: usize,
    pub runs: Vec<FloodRun>,
}

impl FloodSection {
    pub fn run(&self, phase: &str) -> Option<&FloodRun> {
        self.runs.iter().find(|r| r.phase == phase)
    }
}

/// The sold-out gate reopening on one instance when units come back through
/// another, during a flood.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GateSection {
    /// Units sold before the flood's sell-out, and as many returned later.
    pub units: u32,
    /// How often an instance re-checks a shut gate, in milliseconds (the bound).
    pub recheck_ms: u64,
    /// The flood on the first instance.
    pub flood: LoadReport,
    /// Milliseconds from the flood's start to the top-up's answer (second instance).
    pub returned_at_ms: f64,
    /// The `202`s after the units came back, in milliseconds after their return.
    pub accepts_after_return_ms: Vec<f64>,
    /// Requests the flood answered after the last of those `202`s: it went on.
    pub answered_after_last_accept: u64,
}

/// One producer configuration against the broker, 64 publishes in flight.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProducerRun {
    /// The one setting changed from the default, e.g. `linger.ms = 5`.
    pub setting: String,
    pub ceiling: BrokerCeiling,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProducerSection {
    /// The default the other rows change one setting of.
    pub default: String,
    pub runs: Vec<ProducerRun>,
}

/// One mode of the fairness section.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FairnessRun {
    /// `open` or `waiting room`.
    pub mode: String,
    pub winners: usize,
    pub bot_winners: usize,
    /// Seconds after the start when the last user knew their outcome.
    pub last_outcome_after_s: f64,
    /// HTTP requests every client sent (joins, places, reserves, payments).
    pub requests: u64,
    /// Commands Redis processed meanwhile (the commands a script runs count too).
    pub redis_commands: u64,
}

/// The same sale, `open` and through the waiting room, with bots among the users.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FairnessSection {
    pub users: usize,
    pub bots: usize,
    pub units: u32,
    pub runs: Vec<FairnessRun>,
}

/// Answers received in one slice of the failover section's sale, by status
/// (`202`, `409`, `503`, …; `lost` for a connection that failed or timed out).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AnswerBucket {
    /// Start of the slice, in seconds from the kill (negative before it).
    pub t_s: f64,
    pub codes: BTreeMap<String, u64>,
}

/// A sale on a Redis Cluster through the loss of the primary that owns its slot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailoverSection {
    pub units: u32,
    pub users: usize,
    pub clicks: u32,
    /// Requests per second the service answered on the same Cluster, closed loop
    /// at the suite's concurrency, before the sale.
    pub measured_rps: f64,
    pub measure_connections: usize,
    /// The sale's pace (open loop): a share of the measured rate.
    pub rate: f64,
    pub rate_share: f64,
    /// Requests sent, and their pace from the first to the last.
    pub sent: usize,
    pub sent_rps: f64,
    /// The killed primary, and the replica the Cluster promoted in its place.
    pub killed_port: u16,
    pub promoted_port: u16,
    /// Seconds of sale before the kill.
    pub before_s: f64,
    /// Seconds from the kill: the promotion seen in `CLUSTER NODES`, the dead
    /// node started again on its old address, the Cluster healthy again (every
    /// slot served, every replica in sync), the last request sent.
    pub promoted_after_s: f64,
    pub returned_after_s: f64,
    pub healthy_after_s: f64,
    pub ended_after_s: f64,
    /// Time without service (from the mark to the first answer other than a
    /// `5xx` or a lost connection), from the kill and from the promotion;
    /// `None`: service never came back.
    pub gap_from_kill_ms: Option<f64>,
    pub gap_from_promotion_ms: Option<f64>,
    /// After service came back, the longest a new buyer waited again for a real
    /// answer (the node's return included); `None`: service went away again and
    /// never came back.
    pub later_gap_ms: Option<f64>,
    /// Requests sent after the node's return, and how many of them got a `5xx`
    /// or no answer.
    pub sent_after_return: usize,
    pub unserved_after_return: usize,
    /// Every answer, by status and code (`202`, `409 already_reserved`, …).
    pub answers: BTreeMap<String, u64>,
    /// Answers per `bucket_ms`, by status, from the sale's start to its end.
    pub bucket_ms: u64,
    pub timeline: Vec<AnswerBucket>,
    /// The test kit's invariant checker once the sale was quiet.
    pub invariants: ServerCheck,
    /// Seconds after the last answer until the sale was quiet.
    pub drain_s: Option<f64>,
}

// The mega-sale section's figures (`crate::mega` measures them).

/// The flood's compared phases with one configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EnvFlood {
    /// `production` or `test`.
    pub env: String,
    pub runs: Vec<FloodRun>,
    /// Bytes the service wrote to its log meanwhile.
    pub log_bytes: u64,
}

impl EnvFlood {
    pub fn run(&self, phase: &str) -> Option<&FloodRun> {
        self.runs.iter().find(|r| r.phase == phase)
    }
}

/// One slice of a sale's timeline: what the requests in it cost.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PhaseCost {
    pub name: String,
    /// Seconds from the crowd's start (sample bounds around the phase).
    pub from_s: f64,
    pub to_s: f64,
    /// Requests answered in it, by [`crate::mega::crowd::KINDS`], and the `202`s.
    pub by_kind: Vec<u64>,
    pub requests: u64,
    pub accepted: u64,
    pub rps: f64,
    pub service_cpu_s: Option<f64>,
    pub redis_commands: Option<u64>,
    pub redis_script_calls: Option<u64>,
    pub redis_cpu_s: Option<f64>,
}

impl PhaseCost {
    pub fn seconds(&self) -> f64 {
        self.to_s - self.from_s
    }

    fn per(&self, x: Option<f64>, n: u64) -> Option<f64> {
        x.filter(|_| n > 0).map(|x| x / n as f64)
    }

    pub fn cpu_us_per_request(&self) -> Option<f64> {
        self.per(self.service_cpu_s.map(|s| s * 1e6), self.requests)
    }

    pub fn redis_commands_per_request(&self) -> Option<f64> {
        self.per(self.redis_commands.map(|c| c as f64), self.requests)
    }

    pub fn script_calls_per_request(&self) -> Option<f64> {
        self.per(self.redis_script_calls.map(|c| c as f64), self.requests)
    }

    pub fn redis_commands_per_accept(&self) -> Option<f64> {
        self.per(self.redis_commands.map(|c| c as f64), self.accepted)
    }

    pub fn redis_cpu_us_per_accept(&self) -> Option<f64> {
        self.per(self.redis_cpu_s.map(|s| s * 1e6), self.accepted)
    }
}

/// Memory of a sale's keys in Redis.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct KeysMemory {
    pub keys: u64,
    pub bytes: u64,
}

/// One sale of the section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MegaVariant {
    /// `open` or `waiting room`.
    pub admission: String,
    pub stock_shards: u8,
    pub activity_id: String,
    pub units: u32,
    /// Waiting room: the join rate measured on a room of its own before the
    /// sale, and the seconds from the sale's creation to its start set from it.
    pub calibrated_joins_per_s: Option<f64>,
    pub lead_s: Option<f64>,
    pub crowd: CrowdRun,
    /// Seconds from the crowd's start until MySQL held every order, and the
    /// orders it then held.
    pub orders_done_s: Option<f64>,
    pub orders: i64,
    /// The sale's keys in Redis: after the joins, when the crowd ended, once quiet.
    pub redis_after_joins: Option<KeysMemory>,
    pub redis_at_end: KeysMemory,
    pub redis_after_drain: KeysMemory,
    /// The service's resident memory at its start and its peak (`VmHWM`).
    pub rss_at_start_kib: Option<u64>,
    pub peak_rss_kib: Option<u64>,
    /// Bytes the service logged in the whole sale.
    pub log_bytes: u64,
    pub phases: Vec<PhaseCost>,
    pub check: ServerCheck,
}

impl MegaVariant {
    /// When selling began, in seconds from the crowd's start.
    pub fn sale_start_s(&self) -> f64 {
        self.crowd.starts_s.unwrap_or(0.0)
    }

    pub fn sold_out_after_s(&self) -> Option<f64> {
        self.crowd.last_accept_s.map(|t| t - self.sale_start_s())
    }

    pub fn orders_in_mysql_after_s(&self) -> Option<f64> {
        self.orders_done_s.map(|t| t - self.sale_start_s())
    }

    pub fn everyone_knew_after_s(&self) -> Option<f64> {
        (self.crowd.known as usize == self.crowd.users)
            .then_some(self.crowd.last_known_s)
            .flatten()
            .map(|t| t - self.sale_start_s())
    }

    pub fn draw_s(&self) -> Option<f64> {
        self.crowd
            .draw_seen_s
            .zip(self.crowd.starts_s)
            .map(|(d, s)| d - s)
    }

    pub fn joins_per_s(&self) -> Option<f64> {
        self.crowd
            .joins_ended_s
            .map(|t| self.crowd.joined as f64 / t.max(1e-9))
    }

    pub fn answers_5xx(&self) -> u64 {
        self.crowd
            .samples
            .last()
            .and_then(|s| s.answers.get(6).copied())
            .unwrap_or(0)
    }

    pub fn phase(&self, name: &str) -> Option<&PhaseCost> {
        self.phases.iter().find(|p| p.name == name)
    }
}

/// The whole section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MegaSection {
    pub users: usize,
    pub units: u32,
    pub clicks: u32,
    pub connections: usize,
    /// The configuration environment of the sales' servers.
    pub env: String,
    /// Tokens: signing time and the bytes the generator holds for them.
    pub tokens_signed_in_s: f64,
    pub token_bytes: u64,
    /// The flood's compared phases with the deployed and the quiet configuration.
    pub envs: Vec<EnvFlood>,
    pub variants: Vec<MegaVariant>,
    pub scale: Vec<ScalePlan>,
    /// Names of the timeline's answer classes and request kinds.
    pub classes: Vec<String>,
    pub kinds: Vec<String>,
}

impl MegaSection {
    pub fn env(&self, env: &str) -> Option<&EnvFlood> {
        self.envs.iter().find(|e| e.env == env)
    }
}
