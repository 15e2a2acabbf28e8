// prometheus-config: the Prometheus configuration the Prometheus Operator writes for a
// Prometheus resource and the PodMonitors and ServiceMonitors it selects, made by the
// Operator's own generator (github.com/prometheus-operator/prometheus-operator/pkg/prometheus),
// with no cluster behind it: the tests run a real Prometheus with what the chart's monitors
// become, instead of a hand-written scrape configuration.
//
//	prometheus-config PROMETHEUS.yaml MONITORS.yaml > prometheus.yml
//
// MONITORS.yaml holds any number of documents (a `helm template` output will do): the
// PodMonitors and ServiceMonitors among them that the Prometheus resource's podMonitorSelector
// and serviceMonitorSelector match are used, the rest ignored, as the Operator does. Namespace
// selectors on the Prometheus resource are not applied (every namespace is watched).
package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus-operator/prometheus-operator/pkg/assets"
	prompkg "github.com/prometheus-operator/prometheus-operator/pkg/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "prometheus-config: "+format+"\n", args...)
	os.Exit(2)
}

func documents(path string) [][]byte {
	data, err := os.ReadFile(path)
	if err != nil {
		fail("%v", err)
	}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var out [][]byte
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			fail("%s: %v", path, err)
		}
		if len(bytes.TrimSpace(doc)) > 0 {
			out = append(out, doc)
		}
	}
}

func selects(selector *metav1.LabelSelector, objectLabels map[string]string) bool {
	if selector == nil {
		return false // the Operator selects nothing without a selector
	}
	s, err := metav1.LabelSelectorAsSelector(selector)
	if err != nil {
		fail("selector: %v", err)
	}
	return s.Matches(labels.Set(objectLabels))
}

func main() {
	if len(os.Args) != 3 {
		fail("usage: prometheus-config PROMETHEUS.yaml MONITORS.yaml")
	}
	promDocs := documents(os.Args[1])
	if len(promDocs) != 1 {
		fail("%s: one Prometheus resource expected, found %d documents", os.Args[1], len(promDocs))
	}
	var prom monitoringv1.Prometheus
	if err := yaml.UnmarshalStrict(promDocs[0], &prom); err != nil {
		fail("%s: %v", os.Args[1], err)
	}
	podMonitors := map[string]*monitoringv1.PodMonitor{}
	serviceMonitors := map[string]*monitoringv1.ServiceMonitor{}
	for _, doc := range documents(os.Args[2]) {
		var head metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &head); err != nil {
			fail("%s: %v", os.Args[2], err)
		}
		switch head.Kind {
		case "PodMonitor":
			m := &monitoringv1.PodMonitor{}
			if err := yaml.UnmarshalStrict(doc, m); err != nil {
				fail("%s: %v", os.Args[2], err)
			}
			if selects(prom.Spec.PodMonitorSelector, m.Labels) {
				podMonitors[m.Namespace+"/"+m.Name] = m
			}
		case "ServiceMonitor":
			m := &monitoringv1.ServiceMonitor{}
			if err := yaml.UnmarshalStrict(doc, m); err != nil {
				fail("%s: %v", os.Args[2], err)
			}
			if selects(prom.Spec.ServiceMonitorSelector, m.Labels) {
				serviceMonitors[m.Namespace+"/"+m.Name] = m
			}
		}
	}
	generator, err := prompkg.NewConfigGenerator(nil, &prom)
	if err != nil {
		fail("%v", err)
	}
	config, err := generator.GenerateServerConfiguration(
		&prom, serviceMonitors, podMonitors, nil, nil,
		// An empty asset store: the chart's monitors reference no Secrets or ConfigMaps.
		assets.NewTestStoreBuilder(), nil, nil, nil, nil,
	)
	if err != nil {
		fail("%v", err)
	}
	os.Stdout.Write(config)
	fmt.Fprintf(os.Stderr, "prometheus-config: %d PodMonitors, %d ServiceMonitors selected\n",
		len(podMonitors), len(serviceMonitors))
}
