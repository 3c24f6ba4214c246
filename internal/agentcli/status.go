package agentcli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// NodeStatus is what `mesh-agent status -o json` prints.
type NodeStatus struct {
	Agent    AgentStatus         `json:"agent"`
	Datapath *redirect.Snapshot  `json:"datapath,omitempty"`
	Pods     []PodStatus         `json:"pods"`
	Problems []string            `json:"problems,omitempty"`
	Source   string              `json:"source"` // "agent" or "pinned state" (agent down)
	CNI      *gatepb.CNIConfig   `json:"cniConfig,omitempty"`
	Conds    []*gatepb.Condition `json:"conditions,omitempty"`
	// ChainOnDisk is the chain entry read from the config directory when the
	// agent cannot report it (with --cni-install only).
	ChainOnDisk *ChainEntry `json:"chainOnDisk,omitempty"`
}

// AgentStatus says whether the agent answered and is ready.
type AgentStatus struct {
	Reachable bool `json:"reachable"`
	Ready     bool `json:"ready"`
	// NotRunning: nothing serves the gate socket (it is missing, or left by
	// an agent that is gone), as opposed to an agent that does not answer.
	NotRunning bool   `json:"notRunning,omitempty"`
	Error      string `json:"error,omitempty"`
}

// PodStatus is one enrolled pod attachment.
type PodStatus struct {
	Namespace   string    `json:"namespace"`
	Name        string    `json:"name"`
	UID         string    `json:"uid,omitempty"`
	ContainerID string    `json:"containerID"`
	Ifname      string    `json:"ifname"`
	Network     string    `json:"network"`
	NetnsPath   string    `json:"netnsPath"`
	NetnsCookie uint64    `json:"netnsCookie"`
	Interfaces  []string  `json:"interfaces"`
	Source      string    `json:"source"`
	State       string    `json:"state"`
	Since       time.Time `json:"since"`
	// Proxy says how the pod's own sidecar is told apart (redirect.PodState).
	Proxy string `json:"proxy,omitempty"`
}

// Pod states in status output.
const (
	StateRedirected = "redirected"     // map entry and the inbound capture link attached
	StateBroken     = "broken"         // entry present, a link missing or detached
	StateMissing    = "not-redirected" // recorded, but no map entry
	StateRecorded   = "recorded"       // data path none: nothing to check
)

func statusCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var opts options
	fs := flagSet("mesh-agent status", &opts, stderr)
	output := fs.String("o", "table", "output format: table or json")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	opts.markExplicit(fs)
	if *output != "table" && *output != "json" {
		fmt.Fprintf(stderr, "mesh-agent status: -o %q: want table or json\n", *output)
		return 2
	}
	st := collectStatus(ctx, opts)
	if *output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(st); err != nil {
			fmt.Fprintf(stderr, "mesh-agent status: %v\n", err)
			return 1
		}
		return 0
	}
	printStatus(stdout, st)
	return 0
}

// collectStatus asks the running agent and reads the pinned data path; with the
// agent down it falls back to the records on disk.
func collectStatus(ctx context.Context, opts options) NodeStatus {
	st := NodeStatus{Source: "agent"}
	var records []*gatepb.Enrollment
	if err := func() error {
		conn, err := gaterpc.Dial(opts.socketPath)
		if err != nil {
			return err
		}
		defer conn.Close()
		callCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		client := gatepb.NewGateClient(conn)
		s, err := client.Status(callCtx, &gatepb.StatusRequest{}, grpc.WaitForReady(false))
		if err != nil {
			return err
		}
		l, err := client.List(callCtx, &gatepb.ListRequest{})
		if err != nil {
			return err
		}
		st.Agent = AgentStatus{Reachable: true, Ready: s.GetReady()}
		st.CNI, st.Conds, records = s.GetCniConfig(), s.GetConditions(), l.GetEnrollments()
		return nil
	}(); err != nil {
		st.Agent = AgentStatus{Error: err.Error(), NotRunning: nothingServes(opts.socketPath)}
		st.Source = "pinned state"
		if opts.cniInstall {
			// The entry outlives the agent: while it is in place, the plugin
			// holds every new pod's ADD at the gate.
			dir, problem := opts.entryConfDir()
			if problem != "" {
				st.Problems = append(st.Problems, "CNI directories: "+problem)
			}
			ce := readChainEntry(dir, opts.cniConfFile)
			st.ChainOnDisk = &ce
		}
		recs, rerr := podstore.Read(opts.stateDir)
		if rerr != nil {
			st.Problems = append(st.Problems, "read pod records: "+rerr.Error())
		}
		records = enrollmentsFromRecords(recs)
	}

	var pinned map[uint64]redirect.PodState
	if opts.datapath == "ebpf" {
		snap, err := redirect.Inspect(ctx, opts.bpffsRoot)
		if err != nil {
			st.Problems = append(st.Problems, "data path: "+err.Error())
		} else {
			st.Datapath = &snap
			pinned = map[uint64]redirect.PodState{}
			for _, p := range snap.Pods {
				pinned[p.Cookie] = p
			}
		}
	}
	for _, e := range records {
		ps := PodStatus{
			Namespace: e.GetPod().GetNamespace(), Name: e.GetPod().GetName(), UID: e.GetPod().GetUid(),
			ContainerID: e.GetAttachment().GetContainerId(), Ifname: e.GetAttachment().GetIfname(),
			Network: e.GetAttachment().GetNetwork(), NetnsPath: e.GetNetnsPath(), NetnsCookie: e.GetNetnsCookie(),
			Source: strings.TrimPrefix(e.GetSource().String(), "SOURCE_"), Since: time.Unix(0, e.GetEnrolledAtUnixNano()).UTC(),
		}
		for _, i := range e.GetInterfaces() {
			ps.Interfaces = append(ps.Interfaces, i.GetName())
		}
		ps.State = podState(opts.datapath, pinned, ps.NetnsCookie)
		ps.Proxy = pinned[ps.NetnsCookie].Proxy
		st.Pods = append(st.Pods, ps)
	}
	slices.SortFunc(st.Pods, func(a, b PodStatus) int {
		return strings.Compare(a.Namespace+"/"+a.Name+"/"+a.Ifname, b.Namespace+"/"+b.Name+"/"+b.Ifname)
	})
	return st
}

// nothingServes reports whether connecting to the gate socket finds no
// listener: the socket file missing, or left behind by an agent that is gone.
func nothingServes(socket string) bool {
	c, err := net.DialTimeout("unix", socket, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}

func podState(datapath string, pinned map[uint64]redirect.PodState, cookie uint64) string {
	if datapath != "ebpf" {
		return StateRecorded
	}
	p, ok := pinned[cookie]
	if !ok {
		return StateMissing
	}
	if !p.Attached {
		return StateBroken
	}
	return StateRedirected
}

func enrollmentsFromRecords(recs []podstore.Record) []*gatepb.Enrollment {
	out := make([]*gatepb.Enrollment, 0, len(recs))
	for _, r := range recs {
		e := &gatepb.Enrollment{
			Pod:                &gatepb.PodIdentity{Namespace: r.Namespace, Name: r.Name, Uid: r.UID},
			Attachment:         &gatepb.Attachment{ContainerId: r.Key.ContainerID, Ifname: r.Key.Ifname, Network: r.Key.Network},
			NetnsPath:          r.NetnsPath,
			NetnsCookie:        r.NetnsCookie,
			Source:             gatepb.Source(gatepb.Source_value[r.Source]),
			EnrolledAtUnixNano: r.EnrolledAt.UnixNano(),
		}
		for _, i := range r.Interfaces {
			e.Interfaces = append(e.Interfaces, &gatepb.Interface{Name: i.Name})
		}
		out = append(out, e)
	}
	return out
}

func printStatus(w io.Writer, st NodeStatus) {
	switch {
	case st.Agent.NotRunning:
		fmt.Fprintf(w, "agent:      NOT RUNNING (%s); showing pinned state\n", st.Agent.Error)
	case !st.Agent.Reachable:
		fmt.Fprintf(w, "agent:      NOT ANSWERING (%s); showing pinned state\n", st.Agent.Error)
	case st.Agent.Ready:
		fmt.Fprintln(w, "agent:      ready")
	default:
		fmt.Fprintln(w, "agent:      NOT READY")
	}
	for _, c := range st.Conds {
		mark := "ok"
		if !c.GetOk() {
			mark = "NOT MET: " + c.GetReason()
		}
		fmt.Fprintf(w, "  %-12s %s\n", c.GetName(), mark)
	}
	if c := st.CNI; c != nil && c.GetManaged() {
		place := "in place"
		if !c.GetInPlace() {
			place = "MISSING (" + c.GetReason() + ")"
		}
		fmt.Fprintf(w, "chain:      %s in %s (mode %s, primary %s, %d repairs)\n", place, c.GetFile(), c.GetMode(), c.GetPrimaryFile(), c.GetRepairs())
		if d := c.GetDirs(); d != "" {
			fmt.Fprintf(w, "cni dirs:   %s\n", d)
		}
	}
	if c := st.ChainOnDisk; c != nil {
		fmt.Fprintf(w, "chain:      %s\n", chainWithoutAgent(*c, st.Agent.NotRunning))
	}
	if d := st.Datapath; d != nil {
		attached := 0
		for _, h := range d.Hooks {
			if h.Attached {
				attached++
			}
		}
		fmt.Fprintf(w, "datapath:   %s, %d/%d cgroup programs attached, %d namespaces enrolled\n", d.PinRoot, attached, len(d.Hooks), len(d.Pods))
		fmt.Fprintf(w, "counters:   outbound redirected %d passed %d dropped %d; inbound redirected %d passed %d dropped %d\n",
			d.Counters.Outbound.Redirected, d.Counters.Outbound.Passed, d.Counters.Outbound.Dropped,
			d.Counters.Inbound.Redirected, d.Counters.Inbound.Passed, d.Counters.Inbound.Dropped)
	}
	for _, p := range st.Problems {
		fmt.Fprintf(w, "problem:    %s\n", p)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POD\tNETNS COOKIE\tINTERFACES\tSTATE\tSINCE")
	for _, p := range st.Pods {
		fmt.Fprintf(tw, "%s/%s\t%d\t%s\t%s\t%s\n", p.Namespace, p.Name, p.NetnsCookie, strings.Join(p.Interfaces, ","), p.State, p.Since.Format(time.RFC3339))
	}
	tw.Flush()
	for _, p := range st.Pods {
		if p.Proxy != "" {
			fmt.Fprintf(w, "sidecar:    %s/%s: proxy known by %s\n", p.Namespace, p.Name, p.Proxy)
		}
	}
}

// chainWithoutAgent says what the chain entry on disk does to new pods while
// the agent is away: in place, the plugin holds their ADD at the gate.
func chainWithoutAgent(c ChainEntry, notRunning bool) string {
	if !c.InPlace {
		return "NOT IN PLACE: " + c.Problem
	}
	away := "not answering"
	if notRunning {
		away = "not running"
	}
	which := "new pods"
	if len(c.ExcludeNamespaces) > 0 {
		which = "new pods outside " + strings.Join(c.ExcludeNamespaces, ", ")
	}
	return fmt.Sprintf("in place in %s while the agent is %s: %s WAIT AT THE GATE; each sandbox setup fails after %s (gateTimeout) and the kubelet retries it until the agent is back. Running pods keep their redirection.",
		c.File, away, which, c.GateTimeout)
}
