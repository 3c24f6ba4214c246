package cniinstall_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/cniinstall"
)

// The agent's use: install the plugin, then keep the chain entry in place
// while it runs, waiting for readiness before serving pods.
func Example() {
	root, err := os.MkdirTemp("", "mesh-cni-example-")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(root)
	confDir := filepath.Join(root, "net.d")
	_ = os.MkdirAll(confDir, 0o755)
	_ = os.WriteFile(filepath.Join(confDir, "10-bridge.conf"), []byte(`{"cniVersion":"1.0.0","name":"mynet","type":"bridge"}`), 0o644)
	plugin := filepath.Join(root, "mesh-cni")
	_ = os.WriteFile(plugin, []byte("#!/bin/sh\n"), 0o755)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := cniinstall.InstallBinary(ctx, plugin, []string{filepath.Join(root, "bin")}); err != nil {
		fmt.Println(err)
		return
	}
	in, err := cniinstall.New(cniinstall.Config{
		ConfDir:  confDir,
		StateDir: filepath.Join(root, "state"),
		Entry: map[string]any{
			"type":              "mesh-cni",
			"socketPath":        "/var/run/mesh-cni/gate.sock",
			"gateTimeout":       "30s",
			"excludeNamespaces": []string{"kube-system"},
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- in.Run(runCtx) }()
	if err := in.WaitReady(ctx); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("ready:", in.Status().File)
	stop() // the entry stays in place
	<-done

	// Uninstall.
	if err := in.Remove(ctx); err != nil {
		fmt.Println(err)
		return
	}
	_, err = os.Stat(filepath.Join(confDir, "10-bridge.conf"))
	fmt.Println("original back:", err == nil)
	// Output:
	// ready: 10-bridge.conflist
	// original back: true
}
