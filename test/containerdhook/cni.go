package containerdhook

import (
	"errors"
	"fmt"

	types100 "github.com/containernetworking/cni/pkg/types/100"
)

// FromCNI is the primary network's result as the runtime holds it after a
// primary that ran a CNI conflist: every interface with its addresses, the
// routes and DNS.
func FromCNI(res *types100.Result) (*Result, error) {
	if res == nil {
		return nil, errors.New("no CNI result")
	}
	out := &Result{DNS: &DNS{Servers: res.DNS.Nameservers, Searches: res.DNS.Search, Options: res.DNS.Options}}
	for _, i := range res.Interfaces {
		out.Interfaces = append(out.Interfaces, Interface{Name: i.Name, MAC: i.Mac, MTU: uint32(i.Mtu), State: "up"})
	}
	for _, ip := range res.IPs {
		if ip.Interface == nil || *ip.Interface < 0 || *ip.Interface >= len(out.Interfaces) {
			return nil, fmt.Errorf("CNI result IP %v names no interface", ip)
		}
		ni := &out.Interfaces[*ip.Interface]
		ni.Addresses = append(ni.Addresses, ip.Address.String())
	}
	for _, r := range res.Routes {
		re := Route{Destination: r.Dst.String(), Metric: uint32(r.Priority)}
		if r.GW != nil {
			re.Gateway = r.GW.String()
		}
		out.Routes = append(out.Routes, re)
	}
	return out, nil
}
