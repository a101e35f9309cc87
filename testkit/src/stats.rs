//! The statistics the fairness checks need.

/// The central interval of Binomial(`n`, `p`) holding at least `1 − alpha` of it:
/// where the count of one kind among `n` draws lands when each is that kind with
/// chance `p`.
pub fn binomial_interval(n: usize, p: f64, alpha: f64) -> (usize, usize) {
    let mut pmf = vec![0.0; n + 1];
    pmf[0] = (1.0 - p).powi(n as i32);
    for k in 1..=n {
        pmf[k] = pmf[k - 1] * (n - k + 1) as f64 / k as f64 * p / (1.0 - p);
    }
    let (mut lo, mut below) = (0, 0.0);
    while lo < n && below + pmf[lo] < alpha / 2.0 {
        below += pmf[lo];
        lo += 1;
    }
    let (mut hi, mut above) = (n, 0.0);
    while hi > 0 && above + pmf[hi] < alpha / 2.0 {
        above += pmf[hi];
        hi -= 1;
    }
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::binomial_interval;

    #[test]
    fn binomial_intervals() {
        // 100 draws at 10 %: 99 % of the counts lie in [3, 18], 99.9 % in [2, 21].
        assert_eq!(binomial_interval(100, 0.1, 0.01), (3, 18));
        assert_eq!(binomial_interval(100, 0.1, 0.001), (2, 21));
    }
}
