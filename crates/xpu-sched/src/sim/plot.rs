//! A small SVG line chart: GPU allocation ratio against arrived workload, one line per policy
//! (the mean over seeds), like the FGD paper's Figure 7. Plain SVG text; no dependencies.

use std::fmt::Write as _;

/// One line: a label and `(x, y)` points in percent.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [&str; 8] =
    ["#7f7f7f", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#d62728", "#000000", "#8c564b"];

/// The mean of several curves sampled at the same x values (shorter curves end early).
pub fn mean_curve(curves: &[Vec<(f64, f64)>]) -> Vec<(f64, f64)> {
    let n = curves.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            let x = curves[0][i].0;
            let y = curves.iter().map(|c| c[i].1).sum::<f64>() / curves.len() as f64;
            (x, y)
        })
        .collect()
}

/// Renders the chart; `title` goes on top.
pub fn svg(title: &str, series: &[Series]) -> String {
    let (w, h) = (720.0, 460.0);
    let (left, right, top, bottom) = (60.0, 170.0, 40.0, 50.0);
    let (x0, x1, y0, y1) = (0.0, 130.0, 0.0, 100.0);
    let px = |x: f64| left + (x - x0) / (x1 - x0) * (w - left - right);
    let py = |y: f64| h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" font-size="14" text-anchor="middle">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    for i in 0..=13 {
        let x = f64::from(i) * 10.0;
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#eee"/><text x="{0:.1}" y="{3:.1}" text-anchor="middle">{4}</text>"##,
            px(x),
            py(y0),
            py(y1),
            py(y0) + 16.0,
            i * 10
        );
    }
    for i in 0..=10 {
        let y = f64::from(i) * 10.0;
        let _ = writeln!(
            s,
            r##"<line x1="{1:.1}" y1="{0:.1}" x2="{2:.1}" y2="{0:.1}" stroke="#eee"/><text x="{3:.1}" y="{4:.1}" text-anchor="end">{5}</text>"##,
            py(y),
            px(x0),
            px(x1),
            px(x0) - 6.0,
            py(y) + 4.0,
            i * 10
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">arrived GPU request (% of capacity)</text>"#,
        (px(x0) + px(x1)) / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">GPU allocation ratio (%)</text>"#,
        (py(y0) + py(y1)) / 2.0,
        (py(y0) + py(y1)) / 2.0
    );
    for (i, ser) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> =
            ser.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"/>"#,
            pts.join(" ")
        );
        let ly = top + 14.0 + i as f64 * 18.0;
        let lx = w - right + 16.0;
        let last = ser.points.last().map_or(0.0, |p| p.1);
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{} {last:.2}</text>"#,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            escape(&ser.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_a_line_and_label_per_series() {
        let a = Series { label: "fgd".into(), points: vec![(0.0, 0.0), (130.0, 95.4)] };
        let b = Series { label: "x<y".into(), points: vec![(0.0, 0.0), (130.0, 90.0)] };
        let s = svg("OpenB default", &[a, b]);
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("fgd 95.40") && s.contains("x&lt;y 90.00"));
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(mean_curve(&[vec![(0.0, 1.0), (1.0, 3.0)], vec![(0.0, 3.0)]]), vec![(0.0, 2.0)]);
    }
}
