package containerdhook

import (
	"fmt"
	"sort"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/mesh-cni/mesh-cni/test/pbwire"
)

// Field numbers of networking.proto (package containerd.services.networking.v1).
const (
	setupSandboxID, setupNetns, setupName, setupNamespace, setupUID = 1, 2, 3, 4, 5
	setupAnnotations, setupLabels, setupCgroupParent, setupPrev     = 6, 7, 10, 11

	teardownCgroupParent, teardownPrev = 9, 10 // fields 1-7 as in the setup

	resultInterfaces, resultRoutes, resultDNS = 1, 2, 3

	ifName, ifMAC, ifType, ifMTU, ifState, ifAddresses = 1, 2, 3, 4, 5, 6
	rtDest, rtGW, rtIface, rtMetric, rtScope           = 1, 2, 3, 4, 5
	dnsServers, dnsSearches, dnsOptions                = 1, 2, 3

	healthReady, healthMessage = 1, 2

	deviceRDMA = 1
)

func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	return protowire.AppendString(protowire.AppendTag(b, num, protowire.BytesType), s)
}

func appendVarint(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	return protowire.AppendVarint(protowire.AppendTag(b, num, protowire.VarintType), v)
}

func appendMap(b []byte, num protowire.Number, m map[string]string) []byte {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		entry := appendString(appendString(nil, 1, k), 2, m[k])
		b = pbwire.AppendBytes(b, num, entry)
	}
	return b
}

func encodePod(pod Pod) []byte {
	b := appendString(nil, setupSandboxID, pod.SandboxID)
	b = appendString(b, setupNetns, pod.NetnsPath)
	b = appendString(b, setupName, pod.Name)
	b = appendString(b, setupNamespace, pod.Namespace)
	b = appendString(b, setupUID, pod.UID)
	b = appendMap(b, setupAnnotations, pod.Annotations)
	return appendMap(b, setupLabels, pod.Labels)
}

func encodeSetup(pod Pod, prev *Result) []byte {
	b := appendString(encodePod(pod), setupCgroupParent, pod.CgroupParent)
	if prev != nil {
		b = pbwire.AppendBytes(b, setupPrev, encodeResult(prev))
	}
	return b
}

func encodeTeardown(pod Pod, prev *Result) []byte {
	b := appendString(encodePod(pod), teardownCgroupParent, pod.CgroupParent)
	if prev != nil {
		b = pbwire.AppendBytes(b, teardownPrev, encodeResult(prev))
	}
	return b
}

func encodeResult(r *Result) []byte {
	var b []byte
	for _, i := range r.Interfaces {
		m := appendString(nil, ifName, i.Name)
		m = appendString(m, ifMAC, i.MAC)
		if i.RDMA {
			m = appendVarint(m, ifType, deviceRDMA)
		}
		m = appendVarint(m, ifMTU, uint64(i.MTU))
		m = appendString(m, ifState, i.State)
		for _, a := range i.Addresses {
			m = protowire.AppendString(protowire.AppendTag(m, ifAddresses, protowire.BytesType), a)
		}
		b = pbwire.AppendBytes(b, resultInterfaces, m)
	}
	for _, r := range r.Routes {
		m := appendString(nil, rtDest, r.Destination)
		m = appendString(m, rtGW, r.Gateway)
		m = appendString(m, rtIface, r.InterfaceName)
		m = appendVarint(m, rtMetric, uint64(r.Metric))
		m = appendString(m, rtScope, r.Scope)
		b = pbwire.AppendBytes(b, resultRoutes, m)
	}
	if r.DNS != nil {
		var m []byte
		for _, f := range []struct {
			num protowire.Number
			v   []string
		}{{dnsServers, r.DNS.Servers}, {dnsSearches, r.DNS.Searches}, {dnsOptions, r.DNS.Options}} {
			for _, s := range f.v {
				m = protowire.AppendString(protowire.AppendTag(m, f.num, protowire.BytesType), s)
			}
		}
		b = pbwire.AppendBytes(b, resultDNS, m)
	}
	return b
}

func decodeResult(b []byte) (*Result, error) {
	r := &Result{}
	err := pbwire.Walk(b, func(num protowire.Number, _ protowire.Type, v []byte, _ uint64) error {
		switch num {
		case resultInterfaces:
			var i Interface
			if err := pbwire.Walk(v, func(num protowire.Number, _ protowire.Type, v []byte, n uint64) error {
				switch num {
				case ifName:
					i.Name = string(v)
				case ifMAC:
					i.MAC = string(v)
				case ifType:
					i.RDMA = n == deviceRDMA
				case ifMTU:
					i.MTU = uint32(n)
				case ifState:
					i.State = string(v)
				case ifAddresses:
					i.Addresses = append(i.Addresses, string(v))
				}
				return nil
			}); err != nil {
				return err
			}
			r.Interfaces = append(r.Interfaces, i)
		case resultRoutes:
			var rt Route
			if err := pbwire.Walk(v, func(num protowire.Number, _ protowire.Type, v []byte, n uint64) error {
				switch num {
				case rtDest:
					rt.Destination = string(v)
				case rtGW:
					rt.Gateway = string(v)
				case rtIface:
					rt.InterfaceName = string(v)
				case rtMetric:
					rt.Metric = uint32(n)
				case rtScope:
					rt.Scope = string(v)
				}
				return nil
			}); err != nil {
				return err
			}
			r.Routes = append(r.Routes, rt)
		case resultDNS:
			d := &DNS{}
			if err := pbwire.Walk(v, func(num protowire.Number, _ protowire.Type, v []byte, _ uint64) error {
				switch num {
				case dnsServers:
					d.Servers = append(d.Servers, string(v))
				case dnsSearches:
					d.Searches = append(d.Searches, string(v))
				case dnsOptions:
					d.Options = append(d.Options, string(v))
				}
				return nil
			}); err != nil {
				return err
			}
			r.DNS = d
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("decode SetupPodNetworkResponse: %w", err)
	}
	return r, nil
}

func decodeHealth(b []byte) (ready bool, message string, err error) {
	err = pbwire.Walk(b, func(num protowire.Number, _ protowire.Type, v []byte, n uint64) error {
		switch num {
		case healthReady:
			ready = n != 0
		case healthMessage:
			message = string(v)
		}
		return nil
	})
	if err != nil {
		return false, "", fmt.Errorf("decode CheckHealthResponse: %w", err)
	}
	return ready, message, nil
}

// decodePod reads the pod fields a SetupPodNetworkRequest and a
// TeardownPodNetworkRequest share (1-7), as a plugin serving them would.
func decodePod(b []byte) (Pod, error) {
	var p Pod
	err := pbwire.Walk(b, func(num protowire.Number, _ protowire.Type, v []byte, _ uint64) error {
		switch num {
		case setupSandboxID:
			p.SandboxID = string(v)
		case setupNetns:
			p.NetnsPath = string(v)
		case setupName:
			p.Name = string(v)
		case setupNamespace:
			p.Namespace = string(v)
		case setupUID:
			p.UID = string(v)
		case setupAnnotations, setupLabels:
			var k, val string
			if err := pbwire.Walk(v, func(num protowire.Number, _ protowire.Type, v []byte, _ uint64) error {
				switch num {
				case 1:
					k = string(v)
				case 2:
					val = string(v)
				}
				return nil
			}); err != nil {
				return err
			}
			m := &p.Labels
			if num == setupAnnotations {
				m = &p.Annotations
			}
			if *m == nil {
				*m = map[string]string{}
			}
			(*m)[k] = val
		}
		return nil
	})
	if err != nil {
		return Pod{}, fmt.Errorf("decode pod network request: %w", err)
	}
	return p, nil
}

func encodeHealth(ready bool, message string) []byte {
	var b []byte
	if ready {
		b = appendVarint(b, healthReady, 1)
	}
	return appendString(b, healthMessage, message)
}
