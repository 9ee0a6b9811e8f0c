//! Inline SVG charts, drawn on the server: no script, no external asset, and nothing in
//! them comes from a user (only counts, times and fixed labels).

use chrono::{DateTime, Utc};
use maud::{Markup, html};

use crate::store::console::Bucket;

const WIDTH: f64 = 560.0;
const HEIGHT: f64 = 170.0;
const LEFT: f64 = 44.0;
const RIGHT: f64 = 8.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = 26.0;

/// A "nice" axis maximum at or above `max` (1, 2 or 5 times a power of ten).
pub fn nice_max(max: i64) -> i64 {
    if max <= 0 {
        return 1;
    }
    let mut step = 1i64;
    loop {
        for m in [1, 2, 5] {
            match step.checked_mul(m) {
                Some(v) if v >= max => return v,
                Some(_) => {}
                None => return i64::MAX,
            }
        }
        step = match step.checked_mul(10) {
            Some(s) => s,
            None => return i64::MAX,
        };
    }
}

/// Grouped bars of parks and replays per bucket, with a y axis, a legend, an x label every
/// few buckets (`label` formats a bucket's start) and a tooltip per bucket.
pub fn activity(title: &str, buckets: &[Bucket], label: impl Fn(DateTime<Utc>) -> String) -> Markup {
    let max = nice_max(buckets.iter().map(|b| b.parked.max(b.replayed)).max().unwrap_or(0));
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let slot = plot_w / buckets.len().max(1) as f64;
    let bar = (slot * 0.4).max(1.0);
    let y = |v: i64| TOP + plot_h - (v as f64 / max as f64) * plot_h;
    let every = (buckets.len() / 6).max(1);
    let total_parked: i64 = buckets.iter().map(|b| b.parked).sum();
    let total_replayed: i64 = buckets.iter().map(|b| b.replayed).sum();
    html! {
        figure.chart {
            figcaption {
                (title) " — "
                span.legend-parked { "■ parked " (total_parked) }
                " · "
                span.legend-replayed { "■ replayed " (total_replayed) }
            }
            svg xmlns="http://www.w3.org/2000/svg" viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) width=(WIDTH) height=(HEIGHT)
                role="img" aria-label=(format!("{title}: {total_parked} parked, {total_replayed} replayed")) {
                @for frac in [0.0, 0.5, 1.0] {
                    @let v = (max as f64 * frac).round() as i64;
                    line x1=(LEFT) x2=(WIDTH - RIGHT) y1=(fmt(y(v))) y2=(fmt(y(v))) stroke="#ddd" stroke-width="1" {}
                    text x=(LEFT - 4.0) y=(fmt(y(v) + 4.0)) text-anchor="end" font-size="10" fill="#555" { (v) }
                }
                @for (i, b) in buckets.iter().enumerate() {
                    @let x = LEFT + i as f64 * slot + slot * 0.1;
                    g {
                        title { (label(b.start)) ": " (b.parked) " parked, " (b.replayed) " replayed" }
                        rect.parked x=(fmt(x)) y=(fmt(y(b.parked))) width=(fmt(bar)) height=(fmt(TOP + plot_h - y(b.parked))) fill="#d9534f" {}
                        rect.replayed x=(fmt(x + bar)) y=(fmt(y(b.replayed))) width=(fmt(bar)) height=(fmt(TOP + plot_h - y(b.replayed))) fill="#3c8d5a" {}
                    }
                    @if i % every == 0 {
                        text x=(fmt(x + bar)) y=(fmt(HEIGHT - 8.0)) text-anchor="middle" font-size="10" fill="#555" { (label(b.start)) }
                    }
                }
                line x1=(LEFT) x2=(WIDTH - RIGHT) y1=(fmt(TOP + plot_h)) y2=(fmt(TOP + plot_h)) stroke="#888" stroke-width="1" {}
            }
        }
    }
}

fn fmt(v: f64) -> String {
    format!("{v:.1}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_maxima_are_round() {
        assert_eq!(nice_max(0), 1);
        assert_eq!(nice_max(1), 1);
        assert_eq!(nice_max(3), 5);
        assert_eq!(nice_max(7), 10);
        assert_eq!(nice_max(101), 200);
        assert_eq!(nice_max(4_999), 5_000);
        assert_eq!(nice_max(i64::MAX), i64::MAX);
    }

    #[test]
    fn bars_scale_to_the_largest_bucket() {
        let t = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).unwrap();
        let buckets = vec![
            Bucket { start: t, parked: 10, replayed: 0 },
            Bucket { start: t, parked: 5, replayed: 10 },
            Bucket { start: t, parked: 0, replayed: 0 },
        ];
        let svg = activity("Last hour", &buckets, |_| "12:00".into()).into_string();
        assert!(svg.contains("<svg"), "{svg}");
        assert!(svg.contains("15 parked") && svg.contains("10 replayed"), "{svg}");
        // The tallest bar reaches the top of the plot (y = TOP).
        assert!(svg.contains(&format!("y=\"{TOP:.1}\"")), "{svg}");
    }
}
