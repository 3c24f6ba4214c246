package agentcli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"strings"
	"testing"

	"go.uber.org/zap"
)

// Every flag of `mesh-agent run` is also read from its environment variable, the
// command line winning; a value that does not parse names the variable.
func TestFlagsFromEnvironment(t *testing.T) {
	env := map[string]string{
		"MESH_AGENT_INBOUND_PORT": "16006",
		"MESH_AGENT_LOG_LEVEL":    "debug",
		"MESH_AGENT_DNS_CAPTURE":  "true",
	}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	var opts options
	fs := flagSet("mesh-agent run", &opts, io.Discard)
	if err := parseFlags(fs, []string{"--log-level", "warn"}, lookup); err != nil {
		t.Fatal(err)
	}
	if opts.inboundPort != 16006 || !opts.dnsCapture || opts.logLevel != "warn" {
		t.Errorf("inbound port %d, dns capture %v, log level %q: want 16006 and true from the environment, warn from the command line", opts.inboundPort, opts.dnsCapture, opts.logLevel)
	}
	env["MESH_AGENT_OUTBOUND_PORT"] = "port"
	fs = flagSet("mesh-agent run", &opts, io.Discard)
	if err := parseFlags(fs, nil, lookup); err == nil || !strings.Contains(err.Error(), "$MESH_AGENT_OUTBOUND_PORT") {
		t.Errorf("a bad value from the environment: %v, want an error naming the variable", err)
	}
	if got := EnvName("zds-without-service-accounts"); got != "MESH_AGENT_ZDS_WITHOUT_SERVICE_ACCOUNTS" {
		t.Errorf("EnvName: %s", got)
	}
}

// Asking for help or the version is not an error.
func TestHelpAndVersionExitZero(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"help"}, {"run", "-h"}, {"version"}, {"--version"}} {
		var out, errOut bytes.Buffer
		if code := Main(context.Background(), args, &out, &errOut); code != 0 {
			t.Errorf("mesh-agent %v exited %d: %s", args, code, errOut.String())
		}
	}
	var out bytes.Buffer
	Main(context.Background(), []string{"version"}, &out, io.Discard)
	if !strings.HasPrefix(out.String(), "mesh-agent ") || !strings.Contains(out.String(), "data path ") {
		t.Errorf("version: %q", out.String())
	}
}

// The KNI interposer is refused next to the CNI chain entry, which a
// libkni-style runtime would run too (a second pass through the gate), and
// accepted without it.
func TestKNIRefusesChainEntry(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--kni-socket", "/run/kni/kni.sock", "--kni-upstream", "/run/kni/runtime.sock"}, "--cni-install=false"},
		{[]string{"--kni-socket", "/run/kni/kni.sock", "--kni-upstream", "/run/kni/runtime.sock", "--cni-install=true"}, "pass the gate twice"},
	} {
		var opts options
		fs := flagSet("mesh-agent run", &opts, io.Discard)
		if err := parseFlags(fs, tc.args, func(string) (string, bool) { return "", false }); err != nil {
			t.Fatal(err)
		}
		if err := checkKNIChain(opts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error saying %q", tc.args, err, tc.want)
		}
	}
	var opts options
	fs := flagSet("mesh-agent run", &opts, io.Discard)
	if err := parseFlags(fs, []string{"--kni-socket", "/run/kni/kni.sock", "--kni-upstream", "/r.sock", "--cni-install=false"}, func(string) (string, bool) { return "", false }); err != nil {
		t.Fatal(err)
	}
	if err := checkKNIChain(opts); err != nil {
		t.Errorf("KNI without the chain entry: %v", err)
	}
}

// --log-format console writes text lines a person reads in kubectl logs,
// json one object a line; another format is refused at start, by both the
// agent and the hook, before anything runs.
func TestLogFormat(t *testing.T) {
	var js, text bytes.Buffer
	for _, tc := range []struct {
		format string
		out    *bytes.Buffer
	}{{LogFormatJSON, &js}, {LogFormatConsole, &text}} {
		log, err := newLogger("info", tc.format, tc.out)
		if err != nil {
			t.Fatalf("%s: %v", tc.format, err)
		}
		log.Info("chain entry in place", zap.String("file", "05-mesh.conflist"))
		log.Debug("below the level")
	}
	var obj map[string]any
	if err := json.Unmarshal(js.Bytes(), &obj); err != nil || obj["msg"] != "chain entry in place" || obj["file"] != "05-mesh.conflist" || obj["level"] != "info" {
		t.Errorf("json: %q (%v)", js.String(), err)
	}
	line := text.String()
	if strings.Count(line, "\n") != 1 || strings.HasPrefix(line, "{") ||
		!strings.Contains(line, "\tINFO\tchain entry in place\t") || !strings.Contains(line, `"file": "05-mesh.conflist"`) {
		t.Errorf("console: %q, want one text line with the level, the message and the fields", line)
	}
	for _, args := range [][]string{{"run", "--log-format=xml"}, {"hook", "--log-format=xml"}} {
		var errOut bytes.Buffer
		if code := Main(t.Context(), args, io.Discard, &errOut); code != 2 || !strings.Contains(errOut.String(), `--log-format "xml"`) {
			t.Errorf("mesh-agent %v: exit %d, %q: want 2 naming the flag", args, code, errOut.String())
		}
	}
}

// The istio profile's defaults are istio-cni's: DNS captured and failing
// closed, ADD waiting for ztunnel; each is the operator's to override, and
// DNS left uncaptured is not made to fail closed.
func TestIstioProfileDefaults(t *testing.T) {
	none := func(string) (string, bool) { return "", false }
	for _, tc := range []struct {
		args                []string
		capture, failClosed bool
		wait                string
	}{
		{nil, false, false, "auto"},
		{[]string{"--selector-profile", "istio"}, true, true, "always"},
		{[]string{"--selector-profile", "istio", "--dns-fail-closed=false"}, true, false, "always"},
		{[]string{"--selector-profile", "istio", "--dns-capture=false"}, false, false, "always"},
		{[]string{"--selector-profile", "istio", "--zds-wait", "never"}, true, true, "never"},
	} {
		var opts options
		fs := flagSet("mesh-agent run", &opts, io.Discard)
		if err := parseFlags(fs, append([]string{"--zds-socket", "/run/ztunnel/ztunnel.sock"}, tc.args...), none); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		opts.markExplicit(fs)
		if err := opts.applyProfileDefaults(); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if opts.dnsCapture != tc.capture || opts.dnsFailClosed != tc.failClosed || opts.zdsWait != tc.wait {
			t.Errorf("%v: dns capture %v, fail closed %v, zds wait %q; want %v, %v, %q", tc.args,
				opts.dnsCapture, opts.dnsFailClosed, opts.zdsWait, tc.capture, tc.failClosed, tc.wait)
		}
		if _, err := opts.redirectSettings(); err != nil {
			t.Errorf("%v: %v", tc.args, err)
		}
	}
}

// A reconcile interval that is not positive is refused before the agent
// starts: it paces the reconcile pass and the adoption of running pods,
// which would otherwise run back to back against the API server.
func TestReconcileIntervalMustBePositive(t *testing.T) {
	for _, v := range []string{"0s", "-1s"} {
		var opts options
		fs := flagSet("mesh-agent run", &opts, io.Discard)
		if err := parseFlags(fs, []string{"--reconcile-interval", v}, func(string) (string, bool) { return "", false }); err != nil {
			t.Fatal(err)
		}
		if _, err := agentConfig(opts, zap.NewNop()); err == nil || !strings.Contains(err.Error(), "--reconcile-interval") {
			t.Errorf("--reconcile-interval %s: %v, want refused", v, err)
		}
	}
}
