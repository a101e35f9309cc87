//! Real processes on loopback: the `flashsale` binary (with its own clock
//! skewed, if a test asks), and a Redis (or a primary and its replica), MariaDB
//! or tansu broker of a test's own, each on a free port with its data in a
//! temporary folder, so a test may kill, pause or restart them.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

pub fn wait_for_port(port: u16, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn which(name: &str, fallbacks: &[&str]) -> PathBuf {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    for f in fallbacks {
        let p = PathBuf::from(f);
        if p.is_file() {
            return p;
        }
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let cargo = home.join(".cargo/bin").join(name);
    assert!(
        cargo.is_file(),
        "{name} is not installed: run scripts/services.sh"
    );
    cargo
}

/// A child process that is killed when dropped.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Self {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log file");
        let err = out.try_clone().expect("log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .unwrap_or_else(|e| panic!("{name} did not start: {e}"));
        Proc {
            name: name.to_owned(),
            child: Some(child),
            log,
        }
    }

    /// The process id while it runs (its memory can be read off `/proc`).
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `Some(success)` once the process has exited.
    pub fn try_wait(&mut self) -> Option<bool> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => Some(status.success()),
            _ => None,
        }
    }

    /// SIGKILL: no shutdown hook runs, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the process hangs, its sockets stay open (a stalled server).
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// SIGCONT: a paused process carries on where it stopped.
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, name: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .arg(format!("-{name}"))
                .arg(c.id().to_string())
                .status();
        }
    }

    /// SIGTERM and wait: a graceful stop.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub struct Redis {
    pub port: u16,
    proc: Option<Proc>,
    dir: PathBuf,
    /// The primary's port, for a replica.
    replica_of: Option<u16>,
    /// A Redis Cluster node.
    cluster: bool,
}

impl Redis {
    pub fn start(dir: &Path) -> Self {
        Self::start_in(dir, None)
    }

    /// A replica of the Redis on `primary` (its own folder and port).
    pub fn start_replica(dir: &Path, primary: u16) -> Self {
        Self::start_in(dir, Some(primary))
    }

    fn start_in(dir: &Path, replica_of: Option<u16>) -> Self {
        Self::start_node(dir, free_port(), replica_of, false)
    }

    fn start_node(dir: &Path, port: u16, replica_of: Option<u16>, cluster: bool) -> Self {
        let dir = dir.join(format!("redis-{port}"));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut r = Redis {
            port,
            proc: None,
            dir,
            replica_of,
            cluster,
        };
        r.restart_empty();
        r
    }

    /// Starts again with nothing in memory (it keeps nothing on disk).
    pub fn restart_empty(&mut self) {
        self.kill();
        let mut cmd = Command::new(which("redis-server", &["/usr/bin/redis-server"]));
        cmd.args(["--port", &self.port.to_string()]).args([
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            // A new replica syncs at once (the default waits 5 s for others).
            "--repl-diskless-sync-delay",
            "0",
        ]);
        if let Some(primary) = self.replica_of {
            cmd.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
        }
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "2000"]);
        }
        cmd.current_dir(&self.dir);
        self.proc = Some(Proc::spawn("redis", cmd, self.dir.join("redis.log")));
        wait_for_port(self.port, Duration::from_secs(10), "redis");
    }

    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGSTOP / SIGCONT: a replica that falls behind, a primary that hangs.
    pub fn pause(&self) {
        if let Some(p) = &self.proc {
            p.pause();
        }
    }

    pub fn resume(&self) {
        if let Some(p) = &self.proc {
            p.resume();
        }
    }

    /// Makes a replica a primary (`REPLICAOF NO ONE`), as a failover does.
    pub async fn promote(&mut self) -> Result<(), String> {
        self.replica_of = None;
        let client = redis::Client::open(self.url()).map_err(|e| e.to_string())?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        redis::cmd("REPLICAOF")
            .arg("NO")
            .arg("ONE")
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| e.to_string())
    }

    /// Whether a replica has finished its first sync with its primary.
    pub async fn in_sync(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            return false;
        };
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        info.contains("master_link_status:up")
    }
}

/// A primary with two replicas, watched by three sentinels (quorum 2), as
/// deployments that use Sentinel instead of Cluster run it; all on free ports.
/// `down-after-milliseconds` is 2 s, as the Cluster's node timeout.
pub struct RedisSentinel {
    pub nodes: Vec<Redis>,
    sentinels: Vec<(u16, Proc)>,
}

/// The name the sentinels monitor the primary under.
pub const SENTINEL_MASTER: &str = "flashsale";

/// The primary's port as the sentinel on `port` names it.
fn named_primary(port: u16) -> Option<u16> {
    let out = redis_cli(&[
        "-p",
        &port.to_string(),
        "sentinel",
        "get-master-addr-by-name",
        SENTINEL_MASTER,
    ]);
    out.lines()
        .nth(1)
        .and_then(|p| p.trim().parse::<u16>().ok())
}

impl RedisSentinel {
    pub fn start(dir: &Path) -> Result<Self, String> {
        let primary = Redis::start(dir);
        let mut nodes = vec![Redis::start_replica(dir, primary.port)];
        nodes.push(Redis::start_replica(dir, primary.port));
        nodes.insert(0, primary);
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let port = free_port();
            let home = dir.join(format!("sentinel-{port}"));
            std::fs::create_dir_all(&home).map_err(|e| e.to_string())?;
            // Sentinel rewrites its config file as it learns: one of its own.
            let conf = home.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary} 2\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} 2000\n\
                     sentinel failover-timeout {SENTINEL_MASTER} 10000\n\
                     sentinel parallel-syncs {SENTINEL_MASTER} 2\n",
                    dir = home.display(),
                    primary = nodes[0].port,
                ),
            )
            .map_err(|e| e.to_string())?;
            let mut cmd = Command::new(which("redis-server", &["/usr/bin/redis-server"]));
            cmd.arg(&conf).arg("--sentinel").current_dir(&home);
            sentinels.push((
                port,
                Proc::spawn("sentinel", cmd, home.join("sentinel.log")),
            ));
            wait_for_port(port, Duration::from_secs(10), "redis sentinel");
        }
        let s = RedisSentinel { nodes, sentinels };
        s.wait_healthy(Duration::from_secs(30))?;
        Ok(s)
    }

    /// `redis+sentinel://` with every sentinel and the monitored name.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|(port, _)| format!("127.0.0.1:{port}"))
            .collect();
        format!("redis+sentinel://{}/{SENTINEL_MASTER}", hosts.join(","))
    }

    /// The primary's port as every sentinel names it now (`None` while they
    /// disagree).
    pub fn primary(&self) -> Option<u16> {
        let mut named = self.sentinels.iter().map(|(port, _)| named_primary(*port));
        let first = named.next()??;
        named.all(|p| p == Some(first)).then_some(first)
    }

    /// Whether any sentinel already names a primary other than `old` (the
    /// moment a failover is announced; the others learn it within a second).
    pub fn switched_from(&self, old: u16) -> bool {
        self.sentinels
            .iter()
            .any(|(port, _)| named_primary(*port).is_some_and(|p| p != old))
    }

    /// Waits until the sentinels agree on a primary that has two replicas
    /// online, each of them synced.
    pub fn wait_healthy(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let healthy = self.primary().is_some_and(|p| {
                let info = redis_cli(&["-p", &p.to_string(), "info", "replication"]);
                info.contains("role:master")
                    && info.contains("connected_slaves:2")
                    && info.matches("state=online").count() == 2
            });
            if healthy {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the Sentinel deployment was not healthy within {within:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            n.kill();
        }
    }

    /// Starts the node on `port` again, empty, as its supervisor would; the
    /// sentinels turn a returning old primary into a replica.
    pub fn restart(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            n.restart_empty();
        }
    }
}

/// A Redis Cluster of a test's own on free ports: 3 primaries with 2 replicas
/// each, so a primary that fails over still leaves its successor a replica.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
}

/// A free port whose cluster bus port (+10000) is free and valid too.
fn free_cluster_port() -> u16 {
    loop {
        let p = free_port();
        if p < 55_000 && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return p;
        }
    }
}

fn redis_cli(args: &[&str]) -> String {
    Command::new(which("redis-cli", &["/usr/bin/redis-cli"]))
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).replace('\r', ""))
        .unwrap_or_default()
}

impl RedisCluster {
    /// Starts nine nodes and forms the cluster (`redis-cli --cluster create`);
    /// returns once every live node reports `cluster_state:ok`.
    pub fn start(dir: &Path) -> Self {
        // Two clusters starting side by side could each pick a port the other
        // is about to bind (a node's port or its bus port, +10000): one process
        // picks and binds all nine nodes' ports at a time.
        static PICKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let picking = PICKING.lock().unwrap_or_else(|e| e.into_inner());
        let nodes: Vec<Redis> = (0..9)
            .map(|_| Redis::start_node(dir, free_cluster_port(), None, true))
            .collect();
        drop(picking);
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut args: Vec<&str> = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "2", "--cluster-yes"]);
        redis_cli(&args);
        let cluster = RedisCluster { nodes };
        if let Err(e) = cluster.wait_healthy(Duration::from_secs(60)) {
            panic!("{e}");
        }
        cluster
    }

    /// Waits until every live node reports `cluster_state:ok`, every replica has
    /// synced and every primary has an online replica (a `WAIT` for one replica
    /// can succeed).
    pub fn wait_healthy(&self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.nodes.iter().filter(|n| n.proc.is_some()).all(|n| {
                let port = n.port.to_string();
                let replication = redis_cli(&["-p", &port, "info", "replication"]);
                // A replica counts for WAIT once its primary sees it online (after
                // its first acknowledgement, not just the sync).
                redis_cli(&["-p", &port, "cluster", "info"]).contains("cluster_state:ok")
                    && (!replication.contains("role:slave")
                        || replication.contains("master_link_status:up"))
                    && (!replication.contains("role:master")
                        || (replication.contains("slave0:")
                            && !replication.contains("state=wait_bgsave")
                            && !replication.contains("state=send_bulk")
                            && replication.contains("state=online")))
            });
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the Redis Cluster was not healthy within {within:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis+cluster://` with the first three nodes as seeds.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// The port of the primary that serves `key` now.
    pub fn primary_for(&self, key: &str) -> Option<u16> {
        let live = self.nodes.iter().find(|n| n.proc.is_some())?;
        let port = live.port.to_string();
        let slot: u32 = redis_cli(&["-p", &port, "cluster", "keyslot", key])
            .trim()
            .parse()
            .ok()?;
        // CLUSTER NODES: id addr@bus flags master ping pong epoch state slots...
        for line in redis_cli(&["-p", &port, "cluster", "nodes"]).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let serves = f[8..].iter().any(|range| {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                matches!((lo.parse::<u32>(), hi.parse::<u32>()), (Ok(lo), Ok(hi)) if lo <= slot && slot <= hi)
            });
            if serves {
                return f[1].split('@').next()?.rsplit(':').next()?.parse().ok();
            }
        }
        None
    }

    /// The ports of the live nodes that are primaries now.
    pub fn primaries(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.proc.is_some())
            .filter(|n| {
                redis_cli(&["-p", &n.port.to_string(), "info", "replication"])
                    .contains("role:master")
            })
            .map(|n| n.port)
            .collect()
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            n.kill();
        }
    }

    /// Starts the node on `port` again, as its supervisor would: same address,
    /// same `nodes.conf`, nothing in memory.
    pub fn restart(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            n.restart_empty();
        }
    }
}

pub struct MariaDb {
    pub port: u16,
    proc: Option<Proc>,
    data: PathBuf,
    dir: PathBuf,
}

impl MariaDb {
    pub fn start(dir: &Path) -> Self {
        let data = dir.join("mariadb");
        let status = Command::new(which(
            "mariadb-install-db",
            &["/usr/bin/mariadb-install-db"],
        ))
        .args(["--no-defaults", "--auth-root-authentication-method=normal"])
        .args(["--skip-test-db", "--user=root"])
        .arg(format!("--datadir={}", data.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("mariadb-install-db runs");
        assert!(status.success(), "mariadb-install-db failed");
        let mut m = MariaDb {
            port: free_port(),
            proc: None,
            data,
            dir: dir.to_owned(),
        };
        m.start_again();
        m
    }

    pub fn start_again(&mut self) {
        let mut cmd = Command::new(which("mariadbd", &["/usr/sbin/mariadbd"]));
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", self.data.display()))
            .arg(format!("--port={}", self.port))
            .arg(format!(
                "--socket={}",
                self.dir.join("mariadb.sock").display()
            ))
            .args(["--bind-address=127.0.0.1", "--user=root", "--skip-log-bin"])
            .args(["--innodb-buffer-pool-size=64M", "--max-connections=200"]);
        self.proc = Some(Proc::spawn("mariadb", cmd, self.dir.join("mariadb.log")));
        wait_for_port(self.port, Duration::from_secs(30), "mariadb");
    }

    /// SIGKILL: crash recovery on the next start.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    pub fn url(&self, db: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/{db}", self.port)
    }
}

pub struct Broker {
    pub port: u16,
    proc: Option<Proc>,
    dir: PathBuf,
}

impl Broker {
    pub fn start(dir: &Path) -> Self {
        let dir = dir.join("tansu");
        std::fs::create_dir_all(&dir).expect("broker dir");
        let mut b = Broker {
            port: free_port(),
            proc: None,
            dir,
        };
        b.start_again();
        b
    }

    /// Starts on the same port and data, as a restarted broker would.
    pub fn start_again(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let mut cmd = Command::new(which("tansu", &[]));
        cmd.current_dir(&self.dir).args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--storage-engine",
            "sqlite://tansu.db",
        ]);
        self.proc = Some(Proc::spawn("tansu", cmd, self.dir.join("tansu.log")));
        wait_for_port(self.port, Duration::from_secs(10), "tansu");
    }

    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// SIGSTOP: the broker stalls with its connections open; produce requests
    /// sent meanwhile are written when it resumes.
    pub fn pause(&self) {
        if let Some(p) = &self.proc {
            p.pause();
        }
    }

    pub fn resume(&self) {
        if let Some(p) = &self.proc {
            p.resume();
        }
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// How to run one `flashsale` process: the binary, its config folder, and the
/// settings as environment variables (a skewed clock among them:
/// [`Env::skew_clock`]).
#[derive(Clone, Debug)]
pub struct Env {
    pub bin: PathBuf,
    pub config_dir: PathBuf,
    pub vars: Vec<(String, String)>,
}

impl Env {
    /// `bin` is the `flashsale` binary (`env!("CARGO_BIN_EXE_flashsale")` in a
    /// test), `config_dir` its `config/` folder; `FLASHSALE_ENV=test`.
    pub fn new(bin: impl Into<PathBuf>, config_dir: impl Into<PathBuf>) -> Self {
        Env {
            bin: bin.into(),
            config_dir: config_dir.into(),
            vars: Vec::new(),
        }
    }

    pub fn set(&mut self, key: &str, value: impl ToString) {
        let key = key.to_owned();
        self.vars.retain(|(k, _)| *k != key);
        self.vars.push((key, value.to_string()));
    }

    /// The process's own wall clock `secs` seconds off the machine's (ahead
    /// when positive), as `faketime -f +300s` would set it: Debian's
    /// libfaketime preloaded with `FAKETIME`, the monotonic clock left alone
    /// (`FAKETIME_DONT_FAKE_MONOTONIC`), so `SystemTime` moves while tokio's
    /// timers keep their pace. The library goes into the process itself rather
    /// than through the `faketime` command, which runs its program as a child
    /// and waits for it: a kill, a stop or a pause would reach the command and
    /// leave the service running. A library of the test kit's own goes first
    /// (`src/cnd_timedwait.c`): without it, the Kafka client's timed waits
    /// would last as long as the skew.
    pub fn skew_clock(&mut self, secs: i64) {
        self.set(
            "LD_PRELOAD",
            format!(
                "{}:{}",
                env!("FLASHSALE_CND_TIMEDWAIT_SO"),
                faketime_library().display()
            ),
        );
        self.set("FAKETIME", format!("{secs:+}"));
        self.set("FAKETIME_DONT_FAKE_MONOTONIC", 1);
    }
}

/// libfaketime where the `faketime` package puts it: in `faketime/` under
/// the multiarch library folder on Debian (`/usr/lib/x86_64-linux-gnu/`), or
/// under the prefix's `lib/` elsewhere.
fn faketime_library() -> PathBuf {
    for root in ["/usr/lib", "/usr/local/lib"] {
        let mut folders = vec![PathBuf::from(root)];
        if let Ok(entries) = std::fs::read_dir(root) {
            folders.extend(entries.flatten().map(|e| e.path()));
        }
        for folder in folders {
            let library = folder.join("faketime").join("libfaketime.so.1");
            if library.is_file() {
                return library;
            }
        }
    }
    panic!("libfaketime is not installed: run scripts/tools.sh faketime");
}

/// Runs `flashsale <args>` with `env`, its output in `log`.
pub fn flashsale(args: &[&str], env: &Env, log: PathBuf, name: &str) -> Proc {
    let mut cmd = Command::new(&env.bin);
    cmd.args(args)
        .env("FLASHSALE_CONFIG_DIR", &env.config_dir)
        .env("FLASHSALE_ENV", "test")
        // Many consumers share a machine here: each takes a free port.
        .env("FLASHSALE__CONSUMER__METRICS_ADDR", "127.0.0.1:0")
        .env_remove("RUST_LOG");
    for (k, v) in &env.vars {
        cmd.env(k, v);
    }
    Proc::spawn(name, cmd, log)
}

/// A `flashsale serve` on a fixed port, restartable on the same port.
pub struct Service {
    pub port: u16,
    pub proc: Option<Proc>,
    env: Env,
    log: PathBuf,
    name: String,
}

impl Service {
    pub fn start(name: &str, env: &Env, dir: &Path) -> Self {
        let port = free_port();
        let mut env = env.clone();
        env.set("FLASHSALE__SERVER__ADDR", format!("127.0.0.1:{port}"));
        let mut s = Service {
            port,
            proc: None,
            env,
            log: dir.join(format!("{name}.log")),
            name: name.to_owned(),
        };
        s.start_again();
        s
    }

    pub fn start_again(&mut self) {
        self.proc = Some(flashsale(
            &["serve"],
            &self.env,
            self.log.clone(),
            &self.name,
        ));
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{} did not listen on {}:\n{}",
                self.name,
                self.port,
                self.log_head()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Graceful: SIGTERM, and wait for the process to finish its work.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.terminate();
        }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The log's first lines: where a failed start says why.
    pub fn log_head(&self) -> String {
        std::fs::read_to_string(&self.log)
            .map(|t| t.lines().take(15).collect::<Vec<_>>().join("\n"))
            .unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        std::fs::read_to_string(&self.log)
            .map(|t| {
                let lines: Vec<&str> = t.lines().collect();
                lines[lines.len().saturating_sub(30)..].join("\n")
            })
            .unwrap_or_default()
    }
}
