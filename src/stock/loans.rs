//! Units lent between the shards of a split sale: a borrower that took them in
//! the same step as its reservation closes the loan at once; the reconciler
//! finishes the loans a borrower left half done.

use std::collections::HashMap;

use redis::RedisResult;

use super::keys::Keys;
use super::script::arg;
use super::store::StockStore;

/// Units one stock shard lent a sibling, as the lender recorded them (`lend.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loan {
    pub lender: u8,
    pub to: u8,
    pub transfer: String,
    pub units: i64,
    pub lent_at_ms: i64,
    /// The lender's build when it lent: only that build may receive or close it.
    pub epoch: String,
    /// The record as read, so closing it can tell it is still the same loan.
    record: String,
}

impl Loan {
    /// A loan not yet marked done, from its record "units|to|ms|epoch". A record
    /// written before loans carried their epoch ("units|to|ms") takes the
    /// lender's epoch read with it.
    fn parse(lender: u8, transfer: String, record: String, lender_epoch: &str) -> Option<Self> {
        let fields: Vec<&str> = record.split('|').collect();
        let (units, to, at, epoch) = match fields.as_slice() {
            [units, to, at] => (units, to, at, lender_epoch),
            [units, to, at, epoch] if *epoch != "done" => (units, to, at, *epoch),
            _ => return None,
        };
        Some(Loan {
            lender,
            to: to.parse().ok()?,
            units: units.parse().ok()?,
            lent_at_ms: at.parse().ok()?,
            epoch: epoch.to_owned(),
            transfer,
            record,
        })
    }
}

/// What `receive.lua` did with a loan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Received {
    Now,
    Before,
    /// It never will be: lent from another build, or the borrower is not loaded.
    Never,
}

impl Received {
    /// 1 received now, 0 received before, -2 another build, -3 not loaded.
    fn decode(n: i64) -> Self {
        match n {
            1 => Received::Now,
            n if n >= 0 => Received::Before,
            _ => Received::Never,
        }
    }
}

/// `loan_done.lua`'s 1 marked now, 0 left alone.
fn decode_loan_done(n: i64) -> bool {
    n == 1
}

impl StockStore {
    /// Finishes the transfers between shards that their borrower left half done
    /// (lent more than `older_than_ms` ago and not marked done): receives each
    /// once on its borrower, then marks it done on its lender. Returns how many
    /// were received now.
    pub async fn finish_transfers(
        &self,
        activity_id: &str,
        shards: u8,
        older_than_ms: i64,
    ) -> RedisResult<u64> {
        let mut received = 0;
        for loan in self.open_loans(activity_id, shards, older_than_ms).await? {
            if let Some(now) = self.receive_loan(activity_id, shards, &loan).await? {
                received += u64::from(now);
                self.mark_loan_done(activity_id, shards, &loan).await?;
            }
        }
        Ok(received)
    }

    /// The loans between shards lent more than `older_than_ms` ago and not yet
    /// marked done, each as its lender recorded it.
    pub async fn open_loans(
        &self,
        activity_id: &str,
        shards: u8,
        older_than_ms: i64,
    ) -> RedisResult<Vec<Loan>> {
        let mut loans = Vec::new();
        if shards <= 1 {
            return Ok(loans);
        }
        for lender in Keys::all(activity_id, shards) {
            let mut conn = self.conn.clone();
            let (lent, epoch): (HashMap<String, String>, Option<String>) = redis::pipe()
                .hgetall(&lender.lent)
                .get(&lender.epoch)
                .query_async(&mut conn)
                .await?;
            let epoch = epoch.unwrap_or_default();
            for (transfer, record) in lent {
                let Some(loan) = Loan::parse(lender.shard, transfer, record, &epoch) else {
                    continue; // done, or not ours
                };
                if loan.lent_at_ms <= older_than_ms && loan.to < shards {
                    loans.push(loan);
                }
            }
        }
        Ok(loans)
    }

    /// Receives a loan on its borrower, once and only into the build it was lent
    /// from (`receive.lua`). `Some(true)` received now, `Some(false)` received
    /// before; `None` when it never will be (a rebuild wiped it, or the borrower
    /// is not loaded).
    pub async fn receive_loan(
        &self,
        activity_id: &str,
        shards: u8,
        loan: &Loan,
    ) -> RedisResult<Option<bool>> {
        let borrower = Keys::shard(activity_id, shards, loan.to);
        let received = self
            .run(
                &self.receive,
                &[
                    &borrower.stock,
                    &borrower.received,
                    &borrower.epoch,
                    &borrower.restock,
                ],
                &[arg(&loan.transfer), arg(loan.units), arg(&loan.epoch)],
            )
            .await?;
        Ok(match Received::decode(received) {
            Received::Now => {
                self.gate.open(activity_id);
                metrics::counter!("flashsale_stock_shard_transfers_finished_total").increment(1);
                Some(true)
            }
            Received::Before => Some(false),
            Received::Never => None,
        })
    }

    /// Marks a received loan done on its lender (`loan_done.lua`): only while the
    /// lender is still the build that lent it. Returns whether it was marked.
    pub async fn mark_loan_done(
        &self,
        activity_id: &str,
        shards: u8,
        loan: &Loan,
    ) -> RedisResult<bool> {
        let lender = Keys::shard(activity_id, shards, loan.lender);
        let marked = self
            .run(
                &self.loan_done,
                &[&lender.lent, &lender.epoch],
                &[arg(&loan.transfer), arg(&loan.record), arg(&loan.epoch)],
            )
            .await?;
        Ok(decode_loan_done(marked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loan_replies_decode() {
        assert_eq!(
            [1, 0, -2, -3].map(Received::decode),
            [
                Received::Now,
                Received::Before,
                Received::Never,
                Received::Never
            ]
        );
        assert!(decode_loan_done(1));
        assert!(!decode_loan_done(0));
    }

    #[test]
    fn loan_records() {
        let loan = |r: &str| Loan::parse(0, "t>0".into(), r.into(), "7");
        let l = loan("2|1|1000|5").expect("a loan");
        assert_eq!(
            (l.units, l.to, l.lent_at_ms, l.epoch.as_str()),
            (2, 1, 1000, "5")
        );
        // Recorded before loans carried their epoch: the lender's.
        assert_eq!(loan("2|1|1000").expect("a loan").epoch, "7");
        assert_eq!(loan("2|1|1000|done"), None);
        assert_eq!(loan("2|1|1000|5|done"), None);
        assert_eq!(loan("x|1|1000|5"), None);
    }
}
