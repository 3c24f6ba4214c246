package benchreport

import (
	"fmt"
	"image/color"
	"math"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

// Figure size.
var (
	figWidth  = 18 * vg.Centimeter
	figHeight = 10 * vg.Centimeter
)

// cdfMinSamples is the sample count from which a distribution is drawn as a
// CDF (which shows the tail) rather than as a box plot.
const cdfMinSamples = 50

// drawMetric draws m into path (.svg or .png, by the extension) and reports whether there was anything
// to draw. The kind of plot follows the data: medians against X for scaling
// metrics, CDFs for latency distributions, bars for single values, box plots
// for per-round rates.
func drawMetric(m *results.Metric, path string) (drawn bool, err error) {
	// gonum/plot panics on some degenerate inputs; a figure is not worth a crash.
	defer func() {
		if r := recover(); r != nil {
			drawn, err = false, fmt.Errorf("plot: %v", r)
		}
	}()
	maxN := 0
	for _, s := range m.Series {
		maxN = max(maxN, len(s.Samples))
	}
	if maxN == 0 {
		return false, nil
	}
	p := plot.New()
	p.Title.Text = wrap(m.Title, 80)
	p.Legend.Top = true
	switch {
	case m.XLabel != "":
		err = drawScale(p, m)
	case maxN == 1:
		err = drawBars(p, m)
	case !m.HigherIsBetter && maxN >= cdfMinSamples:
		err = drawCDF(p, m)
	default:
		err = drawBoxes(p, m)
	}
	if err != nil {
		return false, err
	}
	if err := p.Save(figWidth, figHeight, path); err != nil {
		return false, fmt.Errorf("save %s: %w", path, err)
	}
	return true, nil
}

func unitLabel(m *results.Metric) string {
	if m.HigherIsBetter {
		return m.Unit + " (higher is better)"
	}
	return m.Unit + " (lower is better)"
}

func drawScale(p *plot.Plot, m *results.Metric) error {
	p.X.Label.Text = m.XLabel
	p.Y.Label.Text = m.Unit + " (median)"
	xs := m.Xs()
	if len(xs) > 0 && xs[0] > 0 && xs[len(xs)-1]/xs[0] >= 10 {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	var args []any
	for _, v := range m.Variants() {
		var pts plotter.XYs
		name := v
		for _, x := range xs {
			s := m.Find(v, x)
			if s == nil || len(s.Samples) == 0 {
				continue
			}
			name = s.DisplayLabel()
			pts = append(pts, plotter.XY{X: x, Y: results.Median(s.Samples)})
		}
		if len(pts) > 0 {
			args = append(args, name, pts)
		}
	}
	if err := plotutil.AddLinePoints(p, args...); err != nil {
		return err
	}
	// Room above the highest point for the legend.
	p.Y.Min = 0
	p.Y.Max *= 1.35
	return nil
}

func drawBars(p *plot.Plot, m *results.Metric) error {
	p.Y.Label.Text = unitLabel(m)
	var vals plotter.Values
	var names []string
	for _, s := range m.Series {
		if len(s.Samples) == 0 {
			continue
		}
		vals = append(vals, s.Samples[0])
		names = append(names, s.Variant)
	}
	bars, err := plotter.NewBarChart(vals, vg.Points(24))
	if err != nil {
		return err
	}
	bars.Color = plotutil.Color(0)
	p.Add(bars)
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
	p.Y.Min = 0
	return nil
}

// drawCDF draws each variant's empirical distribution: the fraction of samples
// at or below a value. The median is where a line crosses 0.5; the tail is the
// top.
func drawCDF(p *plot.Plot, m *results.Metric) error {
	p.X.Label.Text = m.Unit
	p.Y.Label.Text = "fraction of samples ≤ x"
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, s := range m.Series {
		for _, v := range s.Samples {
			lo, hi = min(lo, v), max(hi, v)
		}
	}
	if lo > 0 && hi/lo >= 20 {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	for i, s := range m.Series {
		if len(s.Samples) == 0 {
			continue
		}
		sorted := slices.Clone(s.Samples)
		slices.Sort(sorted)
		// At most ~400 points per line: enough for the shape, small SVGs.
		step := max(1, len(sorted)/400)
		var pts plotter.XYs
		for j := 0; j < len(sorted); j += step {
			pts = append(pts, plotter.XY{X: sorted[j], Y: float64(j+1) / float64(len(sorted))})
		}
		if last := len(sorted) - 1; pts[len(pts)-1].X != sorted[last] {
			pts = append(pts, plotter.XY{X: sorted[last], Y: 1})
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(i)
		l.Dashes = plotutil.Dashes(i)
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(s.DisplayLabel(), l)
	}
	p.Legend.Top = false
	p.Legend.Left = false
	p.Legend.YOffs = vg.Points(10)
	p.Y.Min, p.Y.Max = 0, 1
	p.Add(plotter.NewGrid())
	return nil
}

func drawBoxes(p *plot.Plot, m *results.Metric) error {
	p.Y.Label.Text = unitLabel(m)
	var names []string
	for i, s := range m.Series {
		if len(s.Samples) == 0 {
			continue
		}
		box, err := plotter.NewBoxPlot(vg.Points(30), float64(len(names)), plotter.Values(s.Samples))
		if err != nil {
			return err
		}
		box.FillColor = withAlpha(plotutil.Color(i))
		box.GlyphStyle.Shape = draw.CircleGlyph{}
		p.Add(box)
		names = append(names, s.Variant)
	}
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
	if m.HigherIsBetter {
		// Rates from zero, so the boxes' heights compare honestly.
		p.Y.Min = 0
	}
	p.Add(plotter.NewGrid())
	return nil
}

// withAlpha makes a fill colour from a line colour.
func withAlpha(c color.Color) color.Color {
	r, g, b, _ := c.RGBA()
	return color.NRGBA{R: uint8(r >> 8), G: uint8(g >> 8), B: uint8(b >> 8), A: 0x50}
}

// wrap breaks a title into lines of at most width runes, at spaces.
func wrap(s string, width int) string {
	var lines []string
	line := ""
	for _, word := range strings.Fields(s) {
		if line != "" && len([]rune(line))+1+len([]rune(word)) > width {
			lines = append(lines, line)
			line = word
			continue
		}
		if line != "" {
			line += " "
		}
		line += word
	}
	return strings.Join(append(lines, line), "\n")
}
