package kubeenv

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"k8s.io/client-go/kubernetes"
)

// auditPolicy logs every request's metadata once it is answered (a watch:
// once it has started, and again when it ends).
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
`

// AuditEvent is one request as the API server's audit log has it.
type AuditEvent struct {
	AuditID    string    `json:"auditID"`
	Stage      string    `json:"stage"`
	Verb       string    `json:"verb"`
	RequestURI string    `json:"requestURI"`
	UserAgent  string    `json:"userAgent"`
	Received   time.Time `json:"requestReceivedTimestamp"`
	User       struct {
		Username string `json:"username"`
	} `json:"user"`
	ObjectRef struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
	} `json:"objectRef"`
	ResponseStatus struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
}

// Write reports whether the request asked to change something.
func (e AuditEvent) Write() bool {
	switch e.Verb {
	case "create", "update", "patch", "delete", "deletecollection":
		return true
	}
	return false
}

// Audit returns the requests the API server has answered so far, each once
// (a watch by the stage at which it started), in the log's order. It needs
// APIServerOptions.Audit.
func (s *APIServer) Audit() ([]AuditEvent, error) {
	if s.auditLog == "" {
		return nil, errors.New("the API server keeps no audit log: start it with APIServerOptions.Audit")
	}
	f, err := os.Open(s.auditLog)
	if err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	defer f.Close()
	var out []AuditEvent
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		var e AuditEvent
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			// The server may be writing the last line right now.
			continue
		}
		if seen[e.AuditID] {
			continue
		}
		seen[e.AuditID] = true
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	return out, nil
}

// Metrics scrapes the API server's /metrics with client (an admin's).
func Metrics(ctx context.Context, client kubernetes.Interface) (map[string]*dto.MetricFamily, error) {
	raw, err := client.Discovery().RESTClient().Get().AbsPath("/metrics").Do(ctx).Raw()
	if err != nil {
		return nil, fmt.Errorf("API server /metrics: %w", err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(raw)))
	if err != nil {
		return nil, fmt.Errorf("API server /metrics: %w", err)
	}
	return fams, nil
}

// SumMetric adds up the samples of a counter or gauge family whose labels
// include every pair of match.
func SumMetric(fams map[string]*dto.MetricFamily, name string, match map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return 0
	}
	var sum float64
	for _, m := range f.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		ok := true
		for k, v := range match {
			if labels[k] != v {
				ok = false
			}
		}
		if !ok {
			continue
		}
		switch {
		case m.GetCounter() != nil:
			sum += m.GetCounter().GetValue()
		case m.GetGauge() != nil:
			sum += m.GetGauge().GetValue()
		case m.GetHistogram() != nil:
			// The total of what it observed: bytes, for a size histogram.
			sum += m.GetHistogram().GetSampleSum()
		}
	}
	return sum
}
