package benchreport

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

// Each result's section of the report sits between markers, so that one
// section can be rewritten alone (UpdateSection: a result another command
// measures, such as make e2e-node's node test) and a full Generate keeps the
// sections of results it was not given.
func sectionBegin(name string) string { return "<!-- begin result: " + name + " -->\n" }
func sectionEnd(name string) string   { return "<!-- end result: " + name + " -->\n" }

// section is one marked section of a report.
type section struct {
	name, title, text string // text includes the markers
}

// markedSections returns the report's marked sections, in order.
func markedSections(report string) []section {
	var out []section
	const begin = "<!-- begin result: "
	rest := report
	for {
		i := strings.Index(rest, begin)
		if i < 0 {
			return out
		}
		nameEnd := strings.Index(rest[i:], " -->\n")
		if nameEnd < 0 {
			return out
		}
		name := rest[i+len(begin) : i+nameEnd]
		end := strings.Index(rest[i:], sectionEnd(name))
		if end < 0 {
			return out
		}
		text := rest[i : i+end+len(sectionEnd(name))]
		title := ""
		if t := strings.Index(text, "\n## "); t >= 0 {
			title, _, _ = strings.Cut(text[t+4:], "\n")
		}
		out = append(out, section{name: name, title: title, text: text})
		rest = rest[i+end+len(sectionEnd(name)):]
	}
}

// addContents links title from the report's Contents line, once.
func addContents(report, title string) string {
	link := fmt.Sprintf("[%s](#%s)", title, anchor(title))
	i := strings.Index(report, "Contents: ")
	if i < 0 || strings.Contains(report, link) {
		return report
	}
	end := strings.IndexByte(report[i:], '\n')
	if end < 0 {
		return report
	}
	return report[:i+end] + " · " + link + report[i+end:]
}

// UpdateSection rewrites the section of result name in opts.Out from the
// samples in opts.In, and its figures, leaving the rest of the report as it
// is; a report without that section gets it at the end.
func UpdateSection(opts Options, name string) error {
	if opts.In == "" || opts.Out == "" || opts.FigDir == "" {
		return errors.New("report: In, Out and FigDir are required")
	}
	if opts.Format == "" {
		opts.Format = "svg"
	}
	rs, err := results.ReadDir(opts.In)
	if err != nil {
		return err
	}
	var r *results.Result
	for _, x := range rs {
		if x.Name == name {
			r = x
		}
	}
	if r == nil {
		return fmt.Errorf("no result %q in %s", name, opts.In)
	}
	old, err := os.ReadFile(opts.Out)
	if err != nil {
		return fmt.Errorf("read the report to update: %w", err)
	}
	if err := os.MkdirAll(opts.FigDir, 0o755); err != nil {
		return fmt.Errorf("figure dir: %w", err)
	}
	figLink, err := filepath.Rel(filepath.Dir(opts.Out), opts.FigDir)
	if err != nil {
		return fmt.Errorf("figure dir relative to the report: %w", err)
	}
	var w bytes.Buffer
	if err := writeResult(&w, r, opts, filepath.ToSlash(figLink)); err != nil {
		return err
	}
	report := string(old)
	if i, j := strings.Index(report, sectionBegin(name)), strings.Index(report, sectionEnd(name)); i >= 0 && j > i {
		before := report[i : j+len(sectionEnd(name))]
		report = report[:i] + w.String() + report[j+len(sectionEnd(name)):]
		report = refreshSummary(report, before, w.String(), r)
	} else {
		report = strings.TrimRight(report, "\n") + "\n\n" + w.String()
	}
	report = addContents(report, r.Title)
	if err := os.WriteFile(opts.Out, []byte(report), 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	return nil
}

// refreshSummary carries a rewritten section into the summary at the top of
// report, where make bench's results have rows of their own: the result's row
// of the table of runs, and its rows of the table of every target (the rows
// its section's own target table had before, found there and replaced by the
// new ones). A result the summary does not list leaves it as it was.
func refreshSummary(report, before, after string, r *results.Result) string {
	if old, cur := targetRows(before), targetRows(after); old != "" && cur != "" {
		report = strings.Replace(report, old, cur, 1)
	}
	var run bytes.Buffer
	writeRunLoad(&run, []*results.Result{r})
	lines := strings.SplitAfter(run.String(), "\n")
	prefix := "| " + r.Name + " | "
	if i := strings.Index(report, "\n"+prefix); i >= 0 && len(lines) > 2 {
		rest := ""
		if end := strings.IndexByte(report[i+1:], '\n'); end >= 0 {
			rest = report[i+1+end+1:]
		}
		report = report[:i+1] + lines[2] + rest
	}
	return report
}

// targetRows is the rows of the first target table in text, "" without one.
func targetRows(text string) string {
	const head = "| target | measured | result |\n|---|---|---|\n"
	i := strings.Index(text, head)
	if i < 0 {
		return ""
	}
	rest := text[i+len(head):]
	n := 0
	for strings.HasPrefix(rest[n:], "| ") {
		end := strings.IndexByte(rest[n:], '\n')
		if end < 0 {
			break
		}
		n += end + 1
	}
	return rest[:n]
}
