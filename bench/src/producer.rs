//! The winning path's bound, the broker's acknowledgement, against the producer's
//! settings: the service's own publisher alone, as many publishes in flight as the
//! load has connections, one setting changed from the configured default at a time.

use std::time::Duration;

use flashsale::config::KafkaSettings;

use crate::ceiling;
use crate::context::Bench;
use crate::model::{ProducerRun, ProducerSection};

/// A named change to the producer's settings.
type Change = (String, Box<dyn Fn(&mut KafkaSettings)>);

fn changes(default: &KafkaSettings) -> Vec<Change> {
    let mut out: Vec<Change> = vec![("default".into(), Box::new(|_: &mut KafkaSettings| {}))];
    for linger in [0u64, 5, 20] {
        if linger != default.linger_ms {
            out.push((
                format!("linger.ms = {linger}"),
                Box::new(move |k: &mut KafkaSettings| k.linger_ms = linger),
            ));
        }
    }
    for bytes in [16_384u32, 131_072] {
        out.push((
            format!("batch.size = {bytes}"),
            Box::new(move |k: &mut KafkaSettings| k.batch_bytes = bytes),
        ));
    }
    for in_flight in [1u32, 5] {
        if in_flight != default.max_in_flight {
            out.push((
                format!("max.in.flight = {in_flight}"),
                Box::new(move |k: &mut KafkaSettings| k.max_in_flight = in_flight),
            ));
        }
    }
    for partitions in [1i32, 6] {
        if partitions != default.partitions {
            out.push((
                format!("partitions = {partitions}"),
                Box::new(move |k: &mut KafkaSettings| k.partitions = partitions),
            ));
        }
    }
    out
}

pub async fn section(bench: &Bench) -> anyhow::Result<ProducerSection> {
    let base = &bench.settings.kafka;
    let default = format!(
        "linger.ms = {}, batch.size = {}, max.in.flight = {}, partitions = {}, acks = all, idempotence = {}",
        base.linger_ms, base.batch_bytes, base.max_in_flight, base.partitions, base.idempotent()
    );
    let duration = Duration::from_secs_f64(bench.opts.producer_duration);
    let in_flight = bench.opts.concurrency;
    let mut runs = Vec::new();
    for (setting, change) in changes(base) {
        let mut kafka = base.clone();
        change(&mut kafka);
        eprintln!("== producer: {setting}, {in_flight} publishes in flight");
        let ceiling = ceiling::broker_publish(&kafka, in_flight, duration).await?;
        runs.push(ProducerRun { setting, ceiling });
    }
    Ok(ProducerSection { default, runs })
}
