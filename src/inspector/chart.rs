//! Inline SVG charts for the inspector's pages: stacked bars, one per
//! request or span of time, drawn on the server (no script, no external
//! request), with a legend and a title per bar for screen readers.

use std::fmt::Write as _;

/// One series of a stacked chart: its name and CSS class (`c0`, `c1`…).
pub struct Series<'a> {
    pub name: &'a str,
    pub values: Vec<u64>,
}

const WIDTH: u64 = 720;
const HEIGHT: u64 = 180;
const COLOURS: [&str; 4] = ["#4e79a7", "#59a14f", "#f28e2b", "#b07aa1"];

/// A stacked bar chart: bar `i` stacks `series[k].values[i]`; `labels[i]`
/// names it (shown when hovered and to screen readers).
pub fn stacked(title: &str, labels: &[String], series: &[Series<'_>]) -> String {
    let n = labels.len().max(1) as u64;
    let totals: Vec<u64> = (0..labels.len())
        .map(|i| {
            series
                .iter()
                .map(|s| s.values.get(i).copied().unwrap_or(0))
                .fold(0u64, u64::saturating_add)
        })
        .collect();
    let top = totals.iter().copied().max().unwrap_or(0).max(1);
    let bar = (WIDTH / n).max(1);
    let mut svg = String::with_capacity(512 + labels.len() * 200);
    let _ = write!(
        svg,
        "<svg class=chart role=img viewBox=\"0 0 {WIDTH} {h}\" width=\"100%\" \
         preserveAspectRatio=\"none\"><title>{t}</title>",
        h = HEIGHT + 4,
        t = esc(title)
    );
    for (i, label) in labels.iter().enumerate() {
        let x = i as u64 * bar;
        let mut y = HEIGHT;
        let mut words = Vec::new();
        for (k, s) in series.iter().enumerate() {
            let v = s.values.get(i).copied().unwrap_or(0);
            words.push(format!("{}: {v}", s.name));
            let h = ((u128::from(v) * u128::from(HEIGHT)) / u128::from(top)) as u64;
            if h == 0 {
                continue;
            }
            y = y.saturating_sub(h);
            let _ = write!(
                svg,
                "<rect x={x} y={y} width={w} height={h} fill=\"{c}\"/>",
                w = bar.saturating_sub(1).max(1),
                c = COLOURS[k % COLOURS.len()],
            );
        }
        let _ = write!(
            svg,
            "<rect x={x} y=0 width={bar} height={HEIGHT} fill=transparent><title>{}: {}</title></rect>",
            esc(label),
            esc(&words.join(", "))
        );
    }
    let _ = write!(svg, "</svg><p class=legend>");
    for (k, s) in series.iter().enumerate() {
        let _ = write!(
            svg,
            "<span><i style=\"background:{}\"></i>{}</span> ",
            COLOURS[k % COLOURS.len()],
            esc(s.name)
        );
    }
    let _ = write!(svg, "(highest bar: {top})</p>");
    svg
}

fn esc(s: &str) -> String {
    super::page::esc(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_stack_to_scale_and_say_their_values() {
        let labels = vec!["req 1".to_owned(), "req <2>".to_owned()];
        let svg = stacked(
            "tokens",
            &labels,
            &[
                Series {
                    name: "sent",
                    values: vec![100, 50],
                },
                Series {
                    name: "read",
                    values: vec![100, 0],
                },
            ],
        );
        // The tallest bar fills the height; the other is a quarter of it.
        assert!(svg.contains(&format!("y=90 width={} height=90", WIDTH / 2 - 1)));
        assert!(svg.contains("height=45"));
        assert!(svg.contains("<title>req &lt;2&gt;: sent: 50, read: 0</title>"));
        assert!(svg.contains("(highest bar: 200)"));
        assert!(stacked("empty", &[], &[]).starts_with("<svg"));
    }
}
