//! `compare`: every strategy, the ceilings and the side query, in one run; writes
//! `report.md`, `summary.json` and `runs/*.json` into `--out` (plots come from
//! `scripts/plots.py`). `scripts/bench.sh` is the documented way to run it.

use clap::Parser;
use flashsale_bench::options::SuiteOptions;
use flashsale_bench::suite;

#[derive(Parser)]
#[command(
    name = "compare",
    about = "Compare flashsale's reserve path with the seed's alternatives"
)]
struct Cli {
    #[command(flatten)]
    suite: SuiteOptions,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let out = cli.suite.out.clone();
    let summary = suite::run(cli.suite, command).await?;
    eprintln!(
        "== done in {:.0} s: {}",
        summary.seconds,
        out.join("report.md").display()
    );
    Ok(())
}
