//! `day`: a day in production (many sales, faults, memory and statements over
//! time); writes `report.md` and `day.json` into `--out`. `scripts/bench.sh day`
//! is the documented way to run it (it builds the service's binary beside this
//! one and draws the plots).

use clap::Parser;
use flashsale_bench::day::{self, DayOptions};

#[derive(Parser)]
#[command(name = "day", about = "A day in production of flashsale, measured")]
struct Cli {
    #[command(flatten)]
    day: DayOptions,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let out = cli.day.out.clone();
    let run = day::run(cli.day).await?;
    let broken = run.sales.iter().filter(|s| s.invariants.is_err()).count();
    eprintln!(
        "== done in {:.0} s: {}",
        run.seconds,
        out.join("report.md").display()
    );
    if broken > 0 {
        anyhow::bail!("{broken} of {} sales broke an invariant", run.sales.len());
    }
    Ok(())
}
