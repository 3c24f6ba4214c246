package results

import (
	"math"
	"slices"
)

// Quantile returns the q-quantile (0 ≤ q ≤ 1) of xs by linear interpolation
// between the closest ranks (R's type 7), NaN for no samples. xs is not modified.
func Quantile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return sortedQuantile(s, q)
}

func sortedQuantile(s []float64, q float64) float64 {
	q = min(max(q, 0), 1)
	pos := q * float64(len(s)-1)
	lo := int(math.Floor(pos))
	hi := int(math.Ceil(pos))
	frac := pos - float64(lo)
	return s[lo] + (s[hi]-s[lo])*frac
}

// Median is Quantile(xs, 0.5).
func Median(xs []float64) float64 { return Quantile(xs, 0.5) }

// Summary describes a sample set.
type Summary struct {
	N      int
	Median float64
	// Tail is the 99th percentile in the bad direction: p99 for latencies, p1
	// for rates (higher is better).
	Tail     float64
	Min, Max float64
	// P25, P75 bound the middle half.
	P25, P75 float64
}

// Summarize computes the summary of xs; higherIsBetter picks the tail direction.
func Summarize(xs []float64, higherIsBetter bool) Summary {
	if len(xs) == 0 {
		nan := math.NaN()
		return Summary{Median: nan, Tail: nan, Min: nan, Max: nan, P25: nan, P75: nan}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	tailQ := 0.99
	if higherIsBetter {
		tailQ = 0.01
	}
	return Summary{
		N:      len(s),
		Median: sortedQuantile(s, 0.5),
		Tail:   sortedQuantile(s, tailQ),
		Min:    s[0],
		Max:    s[len(s)-1],
		P25:    sortedQuantile(s, 0.25),
		P75:    sortedQuantile(s, 0.75),
	}
}

// PairedRatio is the median over rounds of a.Rounds[i]/b.Rounds[i], using the
// rounds both have; ok is false when there are none.
func PairedRatio(a, b *Series) (ratio float64, ok bool) {
	return pairedMedian(a, b, func(x, y float64) (float64, bool) { return x / y, y != 0 })
}

// PairedWins counts the rounds in which a did better than b (higher when
// higherIsBetter, lower otherwise), out of the rounds both have.
func PairedWins(a, b *Series, higherIsBetter bool) (wins, rounds int) {
	if a == nil || b == nil {
		return 0, 0
	}
	n := min(len(a.Rounds), len(b.Rounds))
	for i := range n {
		if higherIsBetter == (a.Rounds[i] > b.Rounds[i]) && a.Rounds[i] != b.Rounds[i] {
			wins++
		}
	}
	return wins, n
}

// PairedDiff is the median over rounds of a.Rounds[i]-b.Rounds[i], using the
// rounds both have; ok is false when there are none. For a per-round overhead
// (variant minus baseline run back to back) it is what machine noise affects
// least.
func PairedDiff(a, b *Series) (diff float64, ok bool) {
	return pairedMedian(a, b, func(x, y float64) (float64, bool) { return x - y, true })
}

// pairedMedian is the median of f over the rounds a and b both have, skipping
// rounds where either is NaN or f says its value is undefined; ok is false
// when no round is left.
func pairedMedian(a, b *Series, f func(x, y float64) (float64, bool)) (median float64, ok bool) {
	if a == nil || b == nil {
		return 0, false
	}
	n := min(len(a.Rounds), len(b.Rounds))
	var vs []float64
	for i := range n {
		x, y := a.Rounds[i], b.Rounds[i]
		if math.IsNaN(x) || math.IsNaN(y) {
			continue
		}
		if v, ok := f(x, y); ok {
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return 0, false
	}
	return Median(vs), true
}
