//! The markdown report of a comparison (`results/report.md`): one function per
//! section, each reading the [`Summary`] and nothing else.

mod cluster;
mod failover;
mod flood;
pub mod format;
mod mega;
mod strategies;

use crate::model::Summary;

pub fn render(summary: &Summary) -> String {
    let mut md = String::new();
    if let Some(m) = &summary.mega {
        strategies::title_and_machine(&mut md, summary);
        strategies::ceilings(&mut md, summary);
        mega::section(&mut md, summary, m);
        return md;
    }
    strategies::before(&mut md, summary);
    if let Some(f) = &summary.flood {
        flood::flood(&mut md, f);
    }
    if let Some(g) = &summary.gate {
        flood::gate(&mut md, g);
    }
    if let Some(p) = &summary.producer {
        flood::producer(&mut md, p);
    }
    if let Some(f) = &summary.fairness {
        flood::fairness(&mut md, f);
    }
    if let Some(c) = &summary.cluster {
        cluster::section(&mut md, &c.plan, &c.runs);
        md.push('\n');
    }
    if let Some(f) = &summary.failover {
        failover::section(&mut md, f);
        md.push('\n');
    }
    strategies::after(&mut md, summary);
    md
}
