// Package cniplugin is the mesh-cni chained CNI plugin: it holds a pod's ADD at
// the mesh-agent's gate until the agent has enrolled the pod, and passes the
// primary plugin's result through unchanged.
package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
)

// SupportedVersions are the CNI spec versions mesh-cni accepts. GC and STATUS
// need 1.1.0, CHECK 0.4.0; the chain may be older and still use ADD and DEL.
var supportedVersions = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

// Plugin runs the CNI commands. Stdout is where results go; Stderr receives logs
// when no log file is configured.
type Plugin struct {
	Stdout io.Writer
	Stderr io.Writer
}

// Funcs returns the command table for skel.
func (p Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{
		Add:    p.guard(p.Add),
		Del:    p.guard(p.Del),
		Check:  p.guard(p.Check),
		GC:     p.guard(p.GC),
		Status: p.guard(p.Status),
	}
}

// Main is the plugin's entry point.
func Main() {
	p := Plugin{Stdout: os.Stdout, Stderr: os.Stderr}
	if err := capStdin(os.Getenv("CNI_COMMAND"), MaxStdin); err != nil {
		if perr := err.Print(); perr != nil {
			fmt.Fprintf(os.Stderr, "mesh-cni: %v (and writing the error failed: %v)\n", err, perr)
		}
		os.Exit(1)
	}
	skel.PluginMainFuncs(p.Funcs(), supportedVersions, "mesh-cni: holds pod start until the mesh agent has enrolled the pod")
}

// guard turns a panic into a CNI error instead of a crash with no result.
func (p Plugin) guard(fn func(*skel.CmdArgs) error) func(*skel.CmdArgs) error {
	return func(args *skel.CmdArgs) (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = types.NewError(types.ErrInternal, fmt.Sprintf("mesh-cni: internal error: %v", r), string(debug.Stack()))
			}
		}()
		return fn(args)
	}
}

func (p Plugin) logger(conf *NetConf, args *skel.CmdArgs, cmd string) (*logger, func()) {
	lvl, _ := parseLevel(conf.LogLevel) // validated in parseConfig
	out := p.Stderr
	closeFn := func() {}
	var openErr error
	if conf.LogFile != "" {
		// O_NOFOLLOW: the plugin runs as root, and a symlink planted at the
		// log path must not make it append to (or create) another file.
		f, err := os.OpenFile(conf.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND|unix.O_NOFOLLOW, 0o600)
		if err == nil {
			out = f
			closeFn = func() { f.Close() }
		} else {
			openErr = err
		}
	}
	log := newLogger(out, lvl, nil).With(
		fStr("cmd", cmd),
		fStr("containerID", args.ContainerID),
		fStr("ifname", args.IfName),
		fStr("network", conf.Name),
	)
	if openErr != nil {
		log.Warn("cannot open logFile; logging to stderr", fStr("logFile", conf.LogFile), fErr(openErr))
	}
	// One line per call at debug, whatever the verb: which commands a runtime
	// sends (and how often it polls STATUS) is then in the log.
	log.Debug("cni call")
	return log, closeFn
}

// connect prepares the gate client and a context bounded by timeout; done
// releases the context. The client is gateclient, not grpc-go: the plugin is
// a process per pod and call, and grpc-go's start-up and teardown were most
// of its cost beyond a no-op plugin's (see pkg/gate/gateclient).
func (p Plugin) connect(conf *NetConf, timeout time.Duration) (*gateclient.Client, context.Context, func(), error) {
	if err := socketRefused(conf, ErrGateRefused); err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	return gateclient.New(conf.SocketPath), ctx, cancel, nil
}

// Add implements CNI ADD.
func (p Plugin) Add(args *skel.CmdArgs) error {
	start := time.Now()
	conf, pod, log, done, err := p.podCall(args, "ADD",
		"mesh-cni: no prevResult: mesh-cni is a chained plugin and must come after the primary network plugin in a conflist")
	if err != nil {
		return err
	}
	defer done()
	log = log.With(fStr("pod", pod.Namespace+"/"+pod.Name), fStr("podUID", pod.UID))
	if conf.Excluded(pod.Namespace) {
		log.Info("pod passed through: namespace is excluded from the mesh")
		return types.PrintResult(conf.PrevResult, conf.CNIVersion)
	}
	ifs, err := podInterfacesOf(conf, args)
	if err != nil {
		return err
	}
	parsed := time.Now()

	timeout := time.Duration(conf.GateTimeout)
	client, ctx, done, err := p.connect(conf, timeout)
	if err != nil {
		return err
	}
	defer done()
	// Add waits until the agent is ready (or the gate timeout ends).
	resp, err := client.Add(ctx, &gateclient.AddRequest{
		Pod:        pod.identity(),
		Attachment: conf.attachment(args),
		NetnsPath:  args.Netns,
		Interfaces: ifs,
		Source:     gateclient.SourceCNI,
	})
	if err != nil {
		log.Error("pod not admitted", fErr(err), fDur("waited", time.Since(start)))
		return gateError("ADD", conf.SocketPath, timeout, err)
	}
	log.Info("pod admitted",
		fStr("decision", resp.Decision.String()),
		fStr("reason", resp.Reason),
		fUint("netnsCookie", resp.NetnsCookie))
	log.Debug("add timing",
		fDur("parse", parsed.Sub(start)),
		fDur("gate", time.Since(parsed)),
		fDur("total", time.Since(start)))
	return types.PrintResult(conf.PrevResult, conf.CNIVersion)
}

// confCall parses the config alone, for the calls that do not read
// prevResult, and opens the call's log until done.
func (p Plugin) confCall(args *skel.CmdArgs, cmd string) (*NetConf, *logger, func(), error) {
	conf, err := parseConfigOnly(args.StdinData)
	if err != nil {
		return nil, nil, nil, err
	}
	log, done := p.logger(conf, args, cmd)
	return conf, log, done, nil
}

// podCall parses what ADD and CHECK take: the config, which must carry a
// prevResult (noPrev is the error without one), and the pod's identity. The
// call's log is open until done; on an error it is closed already.
func (p Plugin) podCall(args *skel.CmdArgs, cmd, noPrev string) (*NetConf, PodArgs, *logger, func(), error) {
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return nil, PodArgs{}, nil, nil, err
	}
	log, done := p.logger(conf, args, cmd)
	pod, err := parseArgs(args.Args)
	switch {
	case conf.PrevResult == nil:
		err = types.NewError(types.ErrInvalidNetworkConfig, noPrev, "")
	case err == nil:
		err = pod.requireIdentity()
	}
	if err != nil {
		done()
		return nil, PodArgs{}, nil, nil, err
	}
	return conf, pod, log, done, nil
}

// podInterfacesOf checks CNI_NETNS and reads the pod's interfaces from
// prevResult.
func podInterfacesOf(conf *NetConf, args *skel.CmdArgs) ([]gateclient.Interface, error) {
	if err := netns.Validate(args.Netns); err != nil {
		return nil, types.NewError(types.ErrInvalidNetNS, "mesh-cni: CNI_NETNS is not a network namespace", err.Error())
	}
	result, err := resultOf(conf)
	if err != nil {
		return nil, err
	}
	return podInterfaces(result, args.IfName), nil
}

// resultOf converts prevResult, of whatever version, to the current result type
// to read its interfaces.
func resultOf(conf *NetConf) (*types100.Result, error) {
	res, err := types100.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "mesh-cni: cannot convert prevResult", err.Error())
	}
	return res, nil
}

// podInterfaces lists the interfaces the primary plugin put inside the pod
// (those with a sandbox), with their addresses.
func podInterfaces(res *types100.Result, ifname string) []gateclient.Interface {
	var out []gateclient.Interface
	index := map[int]int{} // result's interface index -> out's
	for i, iface := range res.Interfaces {
		if iface == nil || iface.Sandbox == "" {
			continue
		}
		index[i] = len(out)
		out = append(out, gateclient.Interface{Name: iface.Name, MAC: iface.Mac})
	}
	for _, ip := range res.IPs {
		if ip == nil || ip.Interface == nil {
			continue
		}
		if j, ok := index[*ip.Interface]; ok && ip.Address.IP != nil {
			out[j].Addresses = append(out[j].Addresses, ip.Address.String())
		}
	}
	if len(out) == 0 {
		out = append(out, gateclient.Interface{Name: ifname})
	}
	return out
}

// Del implements CNI DEL. It is best effort: whatever the agent answers, or
// when it cannot be reached, DEL logs and succeeds. A failing DEL makes the
// runtime stop before the primary plugin's DEL (the pod's address leaks and the
// pod sticks in Terminating); the agent releases what it still holds by GC and
// reconcile. prevResult is not parsed: DEL does not use it, and one the plugin
// cannot read must not fail the teardown. Only a configuration that cannot be
// decoded at all is an error.
func (p Plugin) Del(args *skel.CmdArgs) error {
	conf, log, done, err := p.confCall(args, "DEL")
	if err != nil {
		return err
	}
	defer done()
	if err := p.del(conf, args, log); err != nil {
		log.Warn("DEL not passed on to mesh-agent; it releases the pod by GC or reconcile", fErr(err))
	}
	return nil
}

func (p Plugin) del(conf *NetConf, args *skel.CmdArgs, log *logger) error {
	pod, err := parseArgs(args.Args)
	if err != nil {
		// The attachment alone names what to release.
		log.Warn("ignoring CNI_ARGS on DEL", fErr(err))
		pod = PodArgs{}
	}
	if pod.HasIdentity && conf.Excluded(pod.Namespace) {
		return nil
	}
	client, ctx, done, err := p.connect(conf, time.Duration(conf.DelTimeout))
	if err != nil {
		return err
	}
	defer done()
	req := &gateclient.DelRequest{
		Attachment: conf.attachment(args),
		NetnsPath:  args.Netns,
		Source:     gateclient.SourceCNI,
	}
	if pod.HasIdentity {
		id := pod.identity()
		req.Pod = &id
	}
	resp, err := client.Del(ctx, req)
	if isAgentAway(err) {
		return fmt.Errorf("mesh-agent unreachable on %s: %w", conf.SocketPath, err)
	}
	if err != nil {
		return gateError("DEL", conf.SocketPath, time.Duration(conf.DelTimeout), err)
	}
	log.Info("pod deleted", fBool("released", resp.Released))
	return nil
}

// Check implements CNI CHECK.
func (p Plugin) Check(args *skel.CmdArgs) error {
	conf, pod, _, logDone, err := p.podCall(args, "CHECK", "mesh-cni: CHECK needs prevResult")
	if err != nil {
		return err
	}
	defer logDone()
	if conf.Excluded(pod.Namespace) {
		return nil
	}
	ifs, err := podInterfacesOf(conf, args)
	if err != nil {
		return err
	}
	return p.ask(conf, "CHECK", func(ctx context.Context, client *gateclient.Client) error {
		return client.Check(ctx, &gateclient.CheckRequest{
			Pod:        pod.identity(),
			Attachment: conf.attachment(args),
			NetnsPath:  args.Netns,
			Interfaces: ifs,
		})
	})
}

// ask makes one call of op to the agent, bounded by the configuration's
// delTimeout (CHECK and GC, which hold no pod's start), and turns its failure
// into the CNI error the runtime acts on.
func (p Plugin) ask(conf *NetConf, op string, call func(context.Context, *gateclient.Client) error) error {
	timeout := time.Duration(conf.DelTimeout)
	client, ctx, done, err := p.connect(conf, timeout)
	if err != nil {
		return err
	}
	defer done()
	if err := call(ctx, client); err != nil {
		return gateError(op, conf.SocketPath, timeout, err)
	}
	return nil
}

// GC implements CNI GC: the agent releases every attachment of this network that
// the runtime does not list as valid.
func (p Plugin) GC(args *skel.CmdArgs) error {
	conf, log, done, err := p.confCall(args, "GC")
	if err != nil {
		return err
	}
	defer done()
	valid := conf.validAttachments()
	req := &gateclient.GCRequest{Network: conf.Name, Valid: make([]gateclient.Attachment, 0, len(valid))}
	for _, a := range valid {
		req.Valid = append(req.Valid, gateclient.Attachment{ContainerID: a.ContainerID, Ifname: a.IfName, Network: conf.Name})
	}
	return p.ask(conf, "GC", func(ctx context.Context, client *gateclient.Client) error {
		resp, err := client.GC(ctx, req)
		if err == nil {
			log.Info("gc done", fInt("valid", len(valid)), fInt("released", len(resp.Released)))
		}
		return err
	})
}

// Status implements CNI STATUS. It fails only for what no restart of the agent
// can fix: a conflist entry the plugin cannot use, or a gate socket this
// process may not open. An agent that is down, slow or not ready is no reason:
// the kubelet turns a failed STATUS into NetworkReady=false and the node into
// NotReady, which takes every pod on it out of its Services and evicts it. New
// pods wait at the gate either way, so STATUS does not ask the agent at all.
func (p Plugin) Status(args *skel.CmdArgs) error {
	conf, _, logDone, err := p.confCall(args, "STATUS")
	if err != nil {
		return err
	}
	defer logDone()
	return socketRefused(conf, ErrPluginNotAvailable)
}

// socketRefused returns a CNI error with code when the gate socket exists but
// this process may not open it: that would otherwise look like an agent that
// never answers, and no restart of the agent fixes it.
func socketRefused(conf *NetConf, code uint) error {
	if err := unix.Access(conf.SocketPath, unix.W_OK); errors.Is(err, unix.EACCES) {
		return types.NewError(code,
			fmt.Sprintf("mesh-cni: no permission to use gate socket %s (the plugin runs as uid %d; the socket is for root)", conf.SocketPath, os.Getuid()),
			err.Error())
	}
	return nil
}
